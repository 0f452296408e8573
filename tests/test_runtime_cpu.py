"""The runtime on CPU (CI): skips explained and counted once per function, describe(), options."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

import cgtrees
import cgtrees.runtime as runtime
from cgtrees.compiled import AtenGraph, GraphFacts
from cgtrees.config import Config
from cgtrees.context import GraphContext
from cgtrees.runtime import compat
from cgtrees.runtime.examples import Examples
from cgtrees.runtime.function import _changing_dims


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_cpu_inputs_skip_counted_per_function_logged_once_at_info(cgtrees_counters, caplog):
    model = _model()
    f = torch.compile(model, backend="cgtrees")
    with caplog.at_level(logging.INFO, logger="cgtrees"):
        for _ in range(3):
            x = torch.randn(4, 8)
            f(x).sum().backward()  # forward + backward: two functions
        with torch.no_grad():
            for _ in range(3):
                f(torch.randn(4, 8))  # inference: a third
    assert cgtrees_counters["cudagraph_skips"] == 3
    cpu = [r for r in caplog.records if "CPU inputs" in r.getMessage()]
    assert len(cpu) == 1 and cpu[0].levelno == logging.INFO, [r.getMessage() for r in cpu]
    assert cgtrees_counters["cudagraph_replayed"] == 0


def test_describe_names_skipped_functions():
    f = torch.compile(_model(), backend="cgtrees")
    with torch.no_grad():
        f(torch.randn(2, 8))
    text = runtime.describe()
    assert "_inference: no CUDA graphs: CPU inputs" in text, text
    cgtrees.reset()
    assert runtime.describe() == "no CUDA graph trees"


def test_cudagraphs_option_off_counts_no_skip(cgtrees_counters):
    f = torch.compile(_model(), backend="cgtrees", options={"cudagraphs": False})
    with torch.no_grad():
        f(torch.randn(2, 8))
    assert cgtrees_counters["cudagraph_skips"] == 0


def test_wrap_returns_call_for_cpu_inputs(cgtrees_counters):
    def call(args):
        return [args[0] * 2]

    module = SimpleNamespace(call=call, graph=AtenGraph(GraphFacts(), 0))  # a hand-made CompiledModule
    ctx = GraphContext(config=Config.resolve(), kind="inference", name="hand_made")
    assert runtime.wrap(module, Examples.of([torch.ones(2)]), ctx) is call
    assert cgtrees_counters["cudagraph_skips"] == 1
    off = GraphContext(config=Config.resolve(options={"cudagraphs": False}), kind="inference", name="off")
    assert runtime.wrap(module, Examples.of([torch.ones(2)]), off) is call


def test_examples_read_what_wrapping_needs():
    """``Examples``: devices, a mutated input sharing storage with another (a reason to skip, R6's
    copy into its own slot would break the aliasing), and a cache entry's records without tensors."""
    base = torch.zeros(4)
    seen = Examples.of([base, base[:2], torch.ones(3)], mutated=[1])
    assert seen.devices == {torch.device("cpu")} and seen.aliased == (1, 0) and not seen.symbolic
    assert Examples.of([base, base[:2]], mutated=[1], static=[1]).aliased is None  # static: never copied
    assert Examples.of([base, torch.ones(2)], mutated=[1]).aliased is None
    records = [{"size": [2], "stride": [1], "dtype": "float32", "device": "cuda:0"}]
    assert Examples.of_records(records) == Examples(devices=frozenset({torch.device("cuda", 0)}))


def test_compat_on_a_cpu_build():
    report = compat.report()
    assert "_cuda_getCheckpointState" in report
    if not torch.cuda.is_available():
        assert not compat.supported()
    assert isinstance(compat.mark_step_counter(), int)


def test_mark_step_counter_does_not_import_inductor_trees():
    code = ("import sys, torch\nfrom cgtrees.runtime import compat\ncompat.mark_step_counter()\n"
            "print('torch._inductor.cudagraph_trees' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_step_mark_does_not_import_inductor_and_is_seen():
    """After ``import cgtrees``, torch's documented mark is ours: it does not import Inductor's trees
    (2 s of a warm start on the GPU machine's host), and the runtime's counter moves at each mark."""
    code = ("import sys, torch, cgtrees\nfrom cgtrees.runtime import compat\n"
            "seen = [compat.mark_step_counter()]\n"
            "for _ in range(2):\n"
            "    torch.compiler.cudagraph_mark_step_begin()\n"
            "    seen.append(compat.mark_step_counter())\n"
            "print(len(set(seen)), 'torch._inductor.cudagraph_trees' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["3", "False"], out.stdout + out.stderr


def test_the_step_mark_moves_inductors_counter_where_inductor_is_loaded():
    """With Inductor's trees loaded, our mark moves Inductor's counter too (its trees see every
    mark); torch's own function, kept by a caller before cgtrees was imported, is seen by ours."""
    code = ("import sys, torch\nkept = torch.compiler.cudagraph_mark_step_begin\n"
            "import cgtrees\nfrom torch._inductor import cudagraph_trees as trees\n"
            "from cgtrees.runtime import compat\n"
            "before = (trees.MarkStepBox.mark_step_counter, compat.mark_step_counter())\n"
            "torch.compiler.cudagraph_mark_step_begin()\n"
            "ours = (trees.MarkStepBox.mark_step_counter, compat.mark_step_counter())\n"
            "kept()\n"
            "print(before[0] - ours[0], ours[1] != before[1], compat.mark_step_counter() != ours[1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "True", "True"], out.stdout + out.stderr


def test_changing_dimension_is_named():
    keys = [(2, (2, 32), (64, 32)), (3, (3, 32), (64, 32)), (4, (4, 32), (64, 32))]
    text = _changing_dims(keys)
    assert "input 1 dimension 0" in text and "input 0" in text
    assert "input 2" not in text


# ------------------------------------------------------------ reused outputs (liveness.dead)
def _entry_keeping(make):
    """An entry that keeps the tensor ``make()`` returns, as a forward node keeps a saved activation."""
    from cgtrees.runtime.liveness import keeping

    t = make()
    storage = t.untyped_storage()
    return keeping(storage, (storage.data_ptr(), storage.nbytes()), None, 0, t)


def test_a_kept_tensor_is_dead_only_when_nothing_else_holds_it():
    """The test that lets a replay hand out last replay's tensor again: every way a program can
    still reach it (the Python object, a view, a storage, autograd's saved tensors holding the
    TensorImpl alone) keeps it live; held by its entry alone it is idle (dead)."""
    from cgtrees.runtime.liveness import dead

    entry = _entry_keeping(lambda: torch.randn(4, 3))
    assert dead(entry)
    assert entry.alive() is False
    held = entry.cached
    assert not dead(entry)
    del held
    assert dead(entry)
    view = entry.cached[1:]
    assert not dead(entry)
    del view
    storage = entry.cached.untyped_storage()  # the Python object the entry keeps too
    assert not dead(entry)
    del storage
    assert dead(entry)
    other = torch.empty(0).set_(entry.cached.untyped_storage())  # another TensorImpl, same storage
    assert not dead(entry)
    del other
    w = torch.randn(4, 3, requires_grad=True)
    y = w * entry.cached  # autograd saves the TensorImpl (C++ only: no Python reference)
    assert not dead(entry)
    del y
    assert dead(entry)
    entry.cached = entry.cached_storage = None  # forgotten: an ordinary entry, dead with its storage
    assert dead(entry)


def test_an_entry_without_a_kept_tensor_lives_with_its_storage():
    from cgtrees.runtime.liveness import LiveOutput, dead, still_alive

    t = torch.randn(5)
    storage = t.untyped_storage()
    entry = LiveOutput(storage, (storage.data_ptr(), storage.nbytes()), None, 0, None)
    del storage
    assert not dead(entry) and still_alive([entry]) == [entry]
    del t
    assert dead(entry) and still_alive([entry]) == []


def test_forward_context_names_where_its_saved_activations_begin(monkeypatch):
    """The forward's context says which outputs only the backward reads (the runtime reuses
    their tensors): after the user's outputs and the new value of a mutated input."""
    from cgtrees.aot import driver

    seen = []
    compile_graph = driver.Compilers.compile_aten_graph

    def spy(self, gm, example_inputs, ctx):
        outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0]
        seen.append((ctx.kind, ctx.saved_from, len(outputs)))
        return compile_graph(self, gm, example_inputs, ctx)

    monkeypatch.setattr(driver.Compilers, "compile_aten_graph", spy)
    monkeypatch.setenv("CGTREES_CACHE", "0")
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    torch.compile(model, backend="cgtrees")(torch.randn(8, 16)).sum().backward()

    def two_outputs(x, y):
        x.add_(1)  # a buffer-like input written in place: in the graph, not an output
        return (y * 2).sin(), y.exp()

    a, b = torch.compile(two_outputs, backend="cgtrees")(torch.zeros(3), torch.randn(4, requires_grad=True))
    (a.sum() + b.sum()).backward()
    assert [(k, s) for k, s, _ in seen] == [("forward", 1), ("backward", None), ("forward", 2), ("backward", None)]
    assert all(n > s for k, s, n in seen if k == "forward")  # some outputs are saved activations
    with torch.no_grad():
        torch.compile(lambda a: a.cos() * 3, backend="cgtrees")(torch.randn(6))
    assert seen[-1][:2] == ("inference", None)


def test_a_forward_reuses_only_saved_outputs_that_own_their_storage():
    """Which outputs a forward node hands out again (``GraphNode._plan_reuse``): those from
    ``saved_from`` on that own one pool storage alone; a user's output, a saved tensor that shares
    its storage with another output, an input's alias and a constant are rebuilt every replay."""
    from cgtrees.runtime.node import Out

    x, outs = _recorded_outputs()
    node = _planned_node("forward", 1, outs, x)
    assert [kind for kind, _, _ in node.out_plan] == [Out.POOL, Out.POOL, Out.POOL, Out.POOL, Out.INPUT, Out.CONST]
    assert [j for j, _ in node.reuse_plan] == [1]
    # the rest is rebuilt: every output but 1, each pool storage but that one
    assert [j for j, *_ in node.fresh_plan] == [0, 2, 3, 4, 5]
    assert len(node.fresh_keys) == 2 and node.fresh_first == [0, 2]
    for kind, saved_from, copy_out in (("backward", 1, False), ("inference", None, False), ("forward", None, False),
                                       ("forward", 1, True)):
        assert _planned_node(kind, saved_from, outs, x, copy_out).reuse_plan == [], (kind, saved_from, copy_out)


def test_replay_outputs_hand_out_the_kept_tensor_and_build_the_rest(monkeypatch):
    """A forward node's outputs on replay (``GraphNode._outputs``, CPU tensors standing in for the
    pool): the reused output is the same object from the first replay on, unless it was forgotten;
    every other output is a new tensor over the same memory; each storage handed out is live once."""
    import weakref

    # a CUDA build's C call takes CUDA storages only
    monkeypatch.setattr(compat, "tensor_from_storage", compat.tensor_set_to_storage)

    from cgtrees.runtime.liveness import dead

    x, recorded = _recorded_outputs()
    node = _planned_node("forward", 1, recorded, x)
    first = node._outputs([x])
    assert [o is r for o, r in zip(first, recorded)] == [False] * 5 + [True]  # new tensors; the constant
    for o, r in zip(first[:4], recorded[:4]):
        assert torch.equal(o, r) and o.data_ptr() == r.data_ptr()
    assert torch.equal(first[4], x[1:]) and first[4].data_ptr() == x[1:].data_ptr()
    assert len(node.pool.live) == 3  # user, alone, shared: one entry a storage
    entry = node.reused[0]
    assert entry in node.pool.live and not dead(entry)  # held by `first`
    kept, fresh = weakref.ref(first[1]), weakref.ref(first[0])
    del first
    assert dead(entry) and fresh() is None
    node.pool.live.clear()  # as the next call's sweep does
    second = node._outputs([x])
    assert second[1] is kept() and node.reused[0] is entry and len(node.pool.live) == 3
    del second
    node.forget_reused()
    third = node._outputs([x])
    assert third[1] is not kept() and torch.equal(third[1], recorded[1])


def test_replay_outputs_of_a_backward_a_copy_out_node_and_the_fast_path(monkeypatch):
    """The other ways ``GraphNode._outputs`` builds a replay's outputs: a backward tracks every
    storage with weak references to its tensors (R4); a copy-out node hands out copies and tracks
    nothing; outputs that each own a storage take the fast path. Values are the recording's."""
    # a CUDA build's C call takes CUDA storages only
    monkeypatch.setattr(compat, "tensor_from_storage", compat.tensor_set_to_storage)
    x, recorded = _recorded_outputs()
    back = _planned_node("backward", None, recorded, x)
    outs = back._outputs([x])
    live = back.pool.live
    assert [len(e.tensors) for e in live] == [1, 1, 2]  # the shared storage: two outputs
    assert all(ref() is outs[j] for e, js in zip(live, back.outputs_in) for ref, j in zip(e.tensors, js))
    copied = _planned_node("forward", None, recorded, x, copy_out=True)
    outs = copied._outputs([x])
    assert copied.pool.live == [] and outs[0].data_ptr() != recorded[0].data_ptr()
    assert outs[3].untyped_storage().data_ptr() == outs[2].untyped_storage().data_ptr()  # still shared
    assert all(torch.equal(o, r) for o, r in zip(outs[:4], recorded[:4]))
    own = _planned_node("backward", None, recorded[:2], x)
    assert own.simple
    outs = own._outputs([x])
    assert all(torch.equal(o, r) and o is not r for o, r in zip(outs, recorded[:2]))
    assert len(own.pool.live) == 2


def _recorded_outputs() -> tuple[torch.Tensor, list]:
    """An input and a recording's outputs: a user's output, a saved tensor alone in its storage, a
    saved tensor sharing its storage with another output, an input's alias and a constant."""
    x = torch.randn(4, 4)
    user, alone, shared = torch.randn(4, 4), torch.randn(8), torch.randn(4, 4)
    return x, [user, alone, shared, shared.t(), x[1:], 3]


def _planned_node(kind: str, saved_from: int | None, outs: list, x: torch.Tensor, copy_out: bool = False):
    from cgtrees.runtime.node import GraphNode

    ctx = GraphContext(Config.resolve(), kind, "g0_" + kind, saved_from=saved_from)
    pool = SimpleNamespace(device=0, generation=0, live=[])
    node = GraphNode(ctx, GraphFacts(), pool, None, frozenset(), copy_out)
    node.device = x.device
    node.input_storages = {x.untyped_storage().data_ptr(): (0, 0)}
    node._plan_outputs(outs, [x])
    return node


def test_a_consumed_input_replays_only_while_the_call_alone_holds_it(monkeypatch):
    """A backward's consumed inputs (``node._held``): the memory of an activation that died in
    the capture is the graph's, so a replay must see that nothing but the call holds it again. A
    program that kept the tensor (``grad_fn.saved_tensors``, a saved-tensors hook) or another
    graph that saved it holds neither a new storage nor a new TensorImpl: its reference shows only
    in the Python object's count, or the TensorImpl's uses. The forward's own kept tensor
    (``entry.cached``) does not count."""
    from cgtrees.runtime import node as node_mod
    from cgtrees.runtime.node import GraphNode, _held

    monkeypatch.setattr(compat, "keep_graph", lambda: False)
    ctx = GraphContext(Config.resolve(), "backward", "g0_backward")
    node = GraphNode(ctx, GraphFacts(), SimpleNamespace(device=0, generation=0, live=[]), None, frozenset(), False)
    args = [torch.randn(4, 3), torch.randn(5)]  # an activation from the pool, and a copied input
    key = (args[0].untyped_storage().data_ptr(), args[0].untyped_storage().nbytes())
    node._plan_inputs(args, frozenset(), {key[0]}, ())
    assert node.handoff == [0]
    capture_args = node._capture_args(args)
    assert args[0] is None  # handed to the capture
    monkeypatch.setattr(node_mod.WeakStorage, "alive", lambda self: False)  # as if it died there
    node._settle_handoff()
    assert list(node.consumed) == [key]
    holds = node.consumed[key][1]
    args = [capture_args[0], args[1]]  # the next call's arguments: the call holds it alone again
    del capture_args
    idle = SimpleNamespace(cached=None)
    assert not _held(args, holds, idle)
    kept = args[0]  # the program kept it
    assert _held(args, holds, idle)
    del kept
    assert not _held(args, holds, idle)
    w = torch.randn(4, 3, requires_grad=True)
    y = w * args[0]  # another autograd graph saved its TensorImpl
    assert _held(args, holds, idle)
    del y
    assert not _held(args, holds, idle)
    entry = SimpleNamespace(cached=args[0])  # the forward's kept tensor: its entry's reference
    assert not _held(args, holds, entry)
    kept = args[0]
    assert _held(args, holds, entry)
    del kept


def test_copied_bytes_counts_what_a_replay_copies():
    """Static inputs, parameters and live pool outputs are read where they are; every other tensor
    is copied whole, except a broadcast one (one element per stride-0 dimension)."""
    from cgtrees.runtime.node import copied_bytes

    plain, static, pooled = torch.randn(16, 8), torch.randn(100), torch.randn(50)
    param = nn.Parameter(torch.randn(30))
    expanded = torch.randn(1, 8).expand(64, 8)
    args = [plain, static, param, pooled, expanded, 3]
    live = {pooled.untyped_storage().data_ptr()}
    assert copied_bytes(args, frozenset({1}), live) == (16 * 8 + 8) * 4
    assert copied_bytes(args, frozenset(), set()) == (16 * 8 + 100 + 50 + 8) * 4


def test_copies_outweigh_launches_by_the_option():
    """The check of ``max_copy_mb_per_launch``: a reason past the limit, None within it, with the
    option at 0, or where the module's launches are not known."""
    from cgtrees.runtime.function import GraphFunction

    def why(limit, launches, mib):
        fn = SimpleNamespace(config=Config(max_copy_mb_per_launch=limit), launches=launches, static=frozenset(),
                             copied=frozenset())
        return GraphFunction._copies_outweigh_launches(fn, [torch.empty(mib * 2**18)], set(), frozenset())

    assert why(8, 2, 16) is None  # exactly at the limit
    reason = why(8, 2, 17)
    assert reason is not None and "17 MiB" in reason and "2 launches" in reason and "max_copy_mb_per_launch=8" in reason
    assert why(0, 1, 64) is None
    assert why(8, None, 64) is None
    assert Config.resolve(environ={"CGTREES_MAX_COPY_MB_PER_LAUNCH": "2"}).max_copy_mb_per_launch == 2


def _manager_without_cuda(monkeypatch):
    """A tree manager whose pool is not made (no CUDA here): its generation logic only; and the
    counter ``cudagraph_mark_step_begin()`` moves."""
    from cgtrees.runtime import manager as manager_module

    def pool_init(self, device):
        self.device, self.live, self.generation = device, [], 0

    counter = [0]
    monkeypatch.setattr(manager_module.Pool, "__init__", pool_init)
    monkeypatch.setattr(compat, "mark_step_counter", lambda: counter[0])
    return manager_module.TreeManager(0), counter


def test_a_mark_between_a_forward_and_its_backward_ends_the_step_at_the_next_forward(monkeypatch, caplog):
    """``cudagraph_mark_step_begin()`` between a forward and its backward: ending the step there
    would invalidate the activations the backward reads. The step ends at the next forward, as
    after any backward, and the misplaced mark is named once."""
    from cgtrees import logs

    logs.forget()  # named once a process: from here
    manager, counter = _manager_without_cuda(monkeypatch)
    ended = []
    monkeypatch.setattr(manager, "end_generation", lambda why: ended.append(why))
    with caplog.at_level(logging.INFO, logger="cgtrees"):
        manager.begin_call("forward")
        counter[0] += 1  # the misplaced mark
        manager.begin_call("backward")
        manager.begin_call("backward")  # a second graph's backward of the same step
        assert ended == []
        manager.begin_call("forward")  # the next step
        assert ended == ["the next forward began after a backward"]
        counter[0] += 1  # a mark where it belongs: before a forward
        manager.begin_call("forward")
        assert ended[-1] == "torch.compiler.cudagraph_mark_step_begin()"
        counter[0] += 1  # a mark before a backward that follows no forward of this step ends the step
        manager.begin_call("backward")
        assert len(ended) == 3
    named = [r.getMessage() for r in caplog.records if "between a forward and its backward" in r.getMessage()]
    assert len(named) == 1, named


def test_a_shape_whose_nodes_all_went_records_again_instead_of_failing(monkeypatch):
    """Every path where a function's node list for a shape is empty (its nodes all dropped as
    orphans, or a recording that raised before its node was added) records again: nothing reads
    ``nodes[-1]`` of an empty list (an IndexError after a misplaced mark, issue 54)."""
    from cgtrees.runtime.function import GraphFunction

    fn = GraphFunction.__new__(GraphFunction)
    fn.config, fn.static, fn.name = Config(), frozenset(), "g0_backward"
    fn.forget()
    manager = object()
    fn.warmed.add((manager, None))
    recorded = []
    monkeypatch.setattr(fn, "_record", lambda args, m, key, nodes, reason: recorded.append((key, nodes)) or "outs")
    by_key = {None: []}
    assert fn._written_input_moved([], []) is None
    assert fn._no_node_fits([], manager, by_key, None, by_key[None]) == "outs"
    assert recorded == [(None, [])] and recorded[0][1] is by_key[None]
    assert fn.record_reasons["a new shape"] == 1


def test_the_entries_a_step_start_sweeps_are_released_after_the_launch(monkeypatch):
    """At a step's first call the sweep drops every dead entry (a step's gradients, once the
    optimizer cleared them): their release waits until the graph is launched, since before it the
    GPU waits for the host. What stays live is what a backward produced and someone holds."""
    import threading
    import weakref

    from cgtrees.runtime.function import GraphFunction
    from cgtrees.runtime.liveness import LiveOutput, Origin
    from cgtrees.runtime.node import FIT_OK

    manager, counter = _manager_without_cuda(monkeypatch)
    origin = Origin("g0_backward", "backward", None)
    held = torch.empty(3)  # a gradient the user still holds
    freed, free_weak_ref = [], torch.UntypedStorage._free_weak_ref
    dead = []
    for i in range(5):  # gradients set to None: their storages are gone
        t = torch.empty(3)
        entry = LiveOutput(t.untyped_storage(), (i, 12), origin, i, [weakref.ref(t)])
        entry._free = lambda cdata, i=i: (freed.append(i), free_weak_ref(cdata))  # an entry's release
        dead.append(entry)
        del t, entry
    kept = LiveOutput(held.untyped_storage(), (99, 12), origin, 5, [weakref.ref(held)])
    manager.live = [*dead, kept]
    del dead

    at_launch = []

    class Node:
        def fits(self, args, live):
            return FIT_OK

        def replay(self, args):
            at_launch.append(list(freed))
            return "outs"

    fn = GraphFunction.__new__(GraphFunction)
    fn.disabled, fn.kind, fn.dynamic = None, "forward", False
    fn._last = (threading.get_ident(), manager, {None: [Node()]})
    monkeypatch.setattr(manager, "after_replay", lambda node: None)
    counter[0] += 1  # the step's mark: its first call ends the generation
    assert fn([]) == "outs"
    assert manager.live == [kept]
    assert at_launch == [[]]  # no dropped entry was released before the graph launched
    assert manager.dropped is None and sorted(freed) == [0, 1, 2, 3, 4]  # each was, after it
