"""One wrapped aten graph (forward, backward or inference): warmup, record, replay, and its limits.

Invariants:
- The first call for each input shape runs eagerly outside the pool (warmup: lazy handles, Triton
  compilation, autotuning); the next records; later calls replay a node that fits.
- A node fits when its checked input addresses match and every live pool output is protected by
  it. Among a function's nodes the first that fits replays; when none does, a new node is recorded,
  and the reason is counted against a limit:
  * addresses changed (a static input moved): ``max_rerecords_per_function``, then no graphs, with
    a warning; static inputs that moved on each of the last calls, so that no recording of them
    replayed (FSDP2 gathers its parameters anew every step), are copied into slots from then on;
  * a mutated input the program does not mark static is written where it is (a KV cache made
    where the compiled code cannot mark it), and an input of 1 MiB or more is read where it is (a
    batch or a gradient passed at one address), its address checked at each call. When it moves,
    a new recording reads it at its new place (a new cache: the old recording goes with the old
    cache), or, if the last recording never replayed (it moves at every call), copies it into a
    slot from then on; neither is counted against a limit
    (``_max_nodes_per_shape`` bounds them);
  * a live output is in the way (R2): ``max_live_branches_per_function``, then the function's new
    nodes copy their outputs out of the pool, so what the user keeps stays right and nothing more
    accumulates in the pool;
  * a new input shape: ``max_shapes_per_function`` shapes, then no graphs, with a warning naming
    the dimension that kept changing.
- A recording whose replays would copy more than ``max_copy_mb_per_launch`` MiB of inputs per
  kernel launch of the module is not made: the function runs without graphs (logged once, one
  ``cudagraph_skips``). Each replay copies those inputs on the GPU, while a graph saves only the
  host's launches; a graph of few kernels over large inputs (a bandwidth-bound layer's forward fed
  a fresh batch, its backward fed that batch and the output's gradient) is slower replayed.
- A function that runs without graphs says why once (log) and counts one ``cudagraph_skips``.
- One capture at a time in the process: a recording holds ``cgtrees.capture.recording_lock``
  (public as ``cgtrees.runtime.recording_lock``), as codegen's GEMM timings do; why, and the rule
  for a program's other threads, in ``cgtrees.capture``.
"""

from __future__ import annotations

import collections
import enum
import logging
from threading import get_ident
from typing import Any, Callable

import torch

from cgtrees import counters
from cgtrees.capture import recording_lock
from cgtrees.compiled import GraphFacts
from cgtrees.context import GraphContext
from cgtrees.logs import log_once
from cgtrees.runtime import compat, skips
from cgtrees.runtime.manager import Managers, SharedTree, TreeManager
from cgtrees.runtime.node import FIT_OK, Fit, GraphNode, copied_bytes, marked_static

log = logging.getLogger("cgtrees.runtime")


class Why(enum.Enum):
    """Why no node of a function fitted a call (what the new recording counts against)."""

    STATIC_MOVED = "a static input moved"  # max_rerecords_per_function
    LIVE = "a live output is in the way"  # max_live_branches_per_function (R2)
    PARENT = "runs after another node"  # pool inputs elsewhere: a new branch of the tree
    ORPHANS = "its model is gone"  # the dropped nodes' parameters no longer exist
    INPUT_MOVED = "an input read or written in place moved"  # a new KV cache, or one copied from now on

_WORTH_RECORDING = 8  # replays that pay for a recording (a capture costs about what 10 calls do)
_IN_PLACE_BYTES = 1 << 20  # an input this large is read where it is while its address holds


class GraphFunction:
    def __init__(self, call: Callable[[list[Any]], Any], dynamic: bool, ctx: GraphContext,
                 device: int, managers: Managers, facts: GraphFacts, launches: int = 0,
                 shared: SharedTree | None = None, device_scalars: tuple[int, ...] = ()) -> None:
        self.call = call
        self.device_scalars = device_scalars  # CPU 0-d inputs: copied into device slots
        self.ctx = ctx
        self.name = ctx.name
        self.kind = ctx.kind
        self.config = ctx.config
        self.static = frozenset(ctx.static_input_indices)
        self.mutated = tuple(ctx.mutated_input_indices)
        self.device = device
        self.managers = managers
        self.facts = facts
        self.launches = launches  # kernels and aten calls per call (0: not known)
        self.shared = shared  # with the forward or backward of the same graph
        self.dynamic = dynamic  # symbolic sizes: each new size may compile new kernel specializations
        self.forget()

    def forget(self) -> None:
        """Back to the state before the first call (``reset()``)."""
        # nodes by tree manager, then by input shape key: a node belongs to one manager's pool
        self.trees: dict[TreeManager, dict[Any, list[GraphNode]]] = {}
        self._last: tuple[int, TreeManager, dict[Any, list[GraphNode]]] | None = None
        self.warmed: set[tuple[TreeManager, Any]] = set()
        self.disabled: str | None = None
        self.rerecords = 0
        self.live_branches = 0
        self.copy_out = False
        self.shape_keys: list[Any] = []
        self.warm_ptrs: dict[Any, tuple[int, ...]] = {}  # by shape key: the inputs' addresses at its warmup
        self.recorded_keys: set[Any] = set()
        self.copied: frozenset[int] = frozenset()  # inputs whose address changed: copied into slots
        self.record_reasons: collections.Counter[str] = collections.Counter()  # why each recording was made

    # ------------------------------------------------------------ the call
    def __call__(self, args: list[Any]) -> Any:
        if self.disabled is not None:
            return self.call(args)
        last = self._last
        if last is not None and last[0] == get_ident() and not last[1].closed and self.kind != "backward":
            manager, by_key = last[1], last[2]
        else:
            manager, by_key = self._tree()
        live = manager.begin_call(self.kind)
        key = _shape_key(args) if self.dynamic else None
        nodes = by_key.get(key)
        if nodes is not None:
            for node in nodes:
                if node.fits(args, live) is FIT_OK:
                    manager.after_replay(node)
                    counters.bump("cudagraph_replayed")
                    outs = node.replay(args)
                    manager.dropped = None  # what begin_call's sweep dropped, freed after the launch
                    return outs
        return self._no_node_fits(args, manager, by_key, key, nodes)

    def _tree(self) -> tuple[TreeManager, dict[Any, list[GraphNode]]]:
        """This call's manager (the forward's, for a backward) and this function's nodes in it."""
        shared = self.shared
        manager = shared.manager if self.kind == "backward" and shared is not None else None
        if manager is None or manager.closed:
            manager = self.managers.current(self.device)
        if self.kind == "forward" and shared is not None:
            shared.manager = manager
        by_key = self.trees.get(manager)
        if by_key is None:
            by_key = self.trees[manager] = {}
        self._last = (get_ident(), manager, by_key)
        return manager, by_key

    def _no_node_fits(self, args: list[Any], manager: TreeManager, by_key: dict[Any, list[GraphNode]],
                      key: Any, nodes: list[GraphNode] | None) -> Any:
        if (manager, key) not in self.warmed:  # per manager: each thread creates its own handles
            return self._warmup(args, manager, key)
        why: Why | None = None
        if not nodes:  # a new shape, or one whose nodes all went (orphans; a recording that raised)
            if key not in self.shape_keys:
                if len(self.shape_keys) >= self.config.max_shapes_per_function:
                    return self._give_up(args, self._shape_warning(key))
                self.shape_keys.append(key)
            nodes = by_key[key] = nodes if nodes is not None else []
        else:
            why = self._written_input_moved(args, nodes)  # before the orphans go: its old storage may be dead
            if why is not None:
                self._drop_orphans(manager, nodes)
            else:
                why = self._drop_orphans(manager, nodes) or self._why_nodes_fail(args, manager, nodes)
            if why is Why.STATIC_MOVED and self._demote_static(args, nodes):
                pass  # recorded again with the moved inputs copied: not counted
            elif why is Why.STATIC_MOVED:
                self.rerecords += 1
                if self.rerecords > self.config.max_rerecords_per_function:
                    return self._give_up(args, "a static input changed address more than "
                                         f"max_rerecords_per_function={self.config.max_rerecords_per_function} times")
            elif why is Why.LIVE:
                self.live_branches += 1
                if self.live_branches >= self.config.max_live_branches_per_function and not self.copy_out:
                    self.copy_out = True
                    log_once(log, f"copy-out:{self.name}",
                             "cgtrees: %s: outputs kept alive across calls forced %d recordings "
                             "(max_live_branches_per_function); its new recordings copy their outputs "
                             "out of the CUDA graph pool", self.name, self.live_branches, level=logging.INFO)
            if len(nodes) >= self._max_nodes_per_shape():
                return self.call(args)  # kept outputs stay right; no more recordings for this shape
        reason = why.value if why is not None else "a new shape"
        self.record_reasons[reason] += 1
        return self._record(args, manager, key, nodes, reason)

    def _drop_orphans(self, manager: TreeManager, nodes: list[GraphNode]) -> Why | None:
        """Free the nodes whose parameters no longer exist (their model was deleted and a new one
        calls the same compiled code, or a parameter's ``.data`` was replaced): their graphs and
        input slots go. The new recording counts against ``max_rerecords_per_function`` only when
        a dropped graph replayed too few times to have been worth recording (parameters replaced
        every few calls); a sweep of models, each trained a while, records each one.
        Returns STATIC_MOVED when it counts, ORPHANS when not, None when no node was dropped."""
        orphans = [node for node in nodes if node.orphaned()]
        for node in orphans:
            nodes.remove(node)
            manager.release(node)
        if not orphans:
            return None
        return Why.STATIC_MOVED if any(node.replays < _WORTH_RECORDING for node in orphans) else Why.ORPHANS

    def _written_input_moved(self, args: list[Any], nodes: list[GraphNode]) -> Why | None:
        """INPUT_MOVED when a mutated input that the newest recording writes in place (without a
        mark) is elsewhere now. If that recording never replayed, the input moves at every call:
        it is copied into a slot from now on; else it is a new buffer that stays (a new KV cache),
        written in place by the next recording too."""
        if not nodes:
            return None  # no recording to compare with
        latest = nodes[-1]
        moved = {i for i in latest.moved_inputs(args) if not marked_static(i, args[i], self.static)} - self.copied
        if not moved:
            return None
        if latest.replays == 0:
            self.copied = self.copied | moved
        return Why.INPUT_MOVED

    def _demote_static(self, args: list[Any], nodes: list[GraphNode]) -> bool:
        """Copy into slots, from now on, the static inputs that moved at every call since they were
        recorded (no node replayed, after a re-record: FSDP2 gathers its parameters anew each step).
        Whether any was."""
        moved = set().union(*(node.moved_inputs(args) for node in nodes)) - self.copied
        if not moved or self.rerecords < 1 or any(node.replays for node in nodes):
            return False
        log_once(log, f"moving-static:{self.name}",
                 "cgtrees: %s: static inputs %s moved at every call (no recording of them replayed): "
                 "they are copied into the graph's slots from now on", self.name, sorted(moved),
                 level=logging.INFO)
        self.copied = self.copied | moved
        return True

    def _in_place_inputs(self, args: list[Any]) -> frozenset[int]:
        """The inputs a recording reads where they are though the program does not mark them: the
        mutated ones (written where they are: a KV cache), and those of at least ``_IN_PLACE_BYTES``
        (a batch or a gradient the program passes at one address; copied, each replay would read and
        write all of it), not copied since they moved. Where the warmup found them does not matter:
        a tensor made anew each step often settles only after it (autograd's zero gradient for a
        model's unused logits is elsewhere once the optimizer's state exists; its copy was 0.33 ms of
        BERT-base's step on an H200). One that moves at every call costs one more recording, whose
        ``_written_input_moved`` copies it into a slot from then on."""
        mutated = set(self.mutated)
        return frozenset(i for i, a in enumerate(args)
                         if i not in self.copied and isinstance(a, torch.Tensor) and a.data_ptr()
                         and (i in mutated or (a.untyped_storage().nbytes() >= _IN_PLACE_BYTES
                                               and not marked_static(i, a, self.static))))

    def _unmoved(self, args: list[Any], key: Any, i: int) -> bool:
        """Whether input ``i`` is where this shape's warmup found it, or the shape recorded before.
        ``max_copy_mb_per_launch`` counts as copied a large input that moved since the warmup: a
        fresh batch each step would make the in-place recording's replays copy it after all."""
        warm = self.warm_ptrs.get(key)
        return key in self.recorded_keys or warm is None or warm[i] == args[i].data_ptr()

    def _max_nodes_per_shape(self) -> int:
        c = self.config
        return 2 * (c.max_live_branches_per_function + c.max_rerecords_per_function + 2)

    def _why_nodes_fail(self, args: list[Any], manager: TreeManager, nodes: list[GraphNode]) -> Why:
        """STATIC_MOVED when a static input moved for every node; LIVE when some node with
        matching addresses failed only on liveness; PARENT otherwise (pool inputs elsewhere: the
        function runs after a node it has not run after before)."""
        if all(node.static_moved(args) for node in nodes):
            return Why.STATIC_MOVED
        return Why.LIVE if any(node.fits(args, manager.live) is Fit.LIVE for node in nodes) else Why.PARENT

    def _warmup(self, args: list[Any], manager: TreeManager, key: Any) -> Any:
        self.warmed.add((manager, key))
        counters.bump("cudagraph_warmup")
        self.warm_ptrs[key] = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else 0 for a in args)
        _give_back_cached_memory()  # what compiling left cached: the warmup's pool could not reuse it
        # Eagerly, in the tree's warmup pool (``compat.WarmupPool``): a forward's and its backward's
        # warmups share its segments, and they go back to the driver before the recording.
        with manager.warmup_pool().allocating():
            outs = self.call(args)
        _give_back_cached_memory()  # before the optimizer's first state is allocated, after a backward's warmup
        return outs

    def _record(self, args: list[Any], manager: TreeManager, key: Any, nodes: list[GraphNode],
                reason: str = "a new shape") -> Any:
        with recording_lock:  # one recording at a time in the process (the invariants above)
            live = manager.prepare_recording()
            stable = self._in_place_inputs(args)
            settled = frozenset(i for i in stable if self._unmoved(args, key, i))  # the policy's guess
            too_costly = self._copies_outweigh_launches(args, {e.key[0] for e in live}, settled)
            if too_costly is not None:
                return self._give_up(args, too_costly)
            node = GraphNode(self.ctx, self.facts, manager, manager.last_node, frozenset(e.key for e in live),
                             self.copy_out)
            node.key, node.reason = key, reason  # what the picture of the tree shows (runtime.picture)
            try:
                outs = node.record(self.call, args, self.static, self.mutated, {e.key[0] for e in live},
                                   stable, self.copied, self.device_scalars)
            except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: run it eagerly
                manager.release(node)
                compat.recover_generator(manager.device)
                return self._give_up(args, f"capture failed ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        nodes.append(node)
        self.recorded_keys.add(key)
        manager.after_recording(node)
        counters.bump("cudagraph_recorded")
        args.clear()
        return outs if node.returns_list else outs[0]

    def _copies_outweigh_launches(self, args: list[Any], live_ptrs: set[int], stable: frozenset[int]) -> str | None:
        """Why recording now would not pay (``max_copy_mb_per_launch``), or None."""
        limit = self.config.max_copy_mb_per_launch
        if limit <= 0 or not self.launches:
            return None
        copied = copied_bytes(args, self.static | stable, live_ptrs, self.copied)
        if copied <= limit * 2**20 * self.launches:
            return None
        return (f"its replays would copy {copied / 2**20:.0f} MiB of inputs for {self.launches} launches "
                f"(more than max_copy_mb_per_launch={limit} MiB each): the copies cost more than the graph saves")

    def _give_up(self, args: list[Any], reason: str) -> Any:
        self.disabled = reason
        skip(self.name, reason)
        for manager, by_key in self.trees.items():
            for nodes in by_key.values():
                for node in nodes:
                    manager.release(node)
        self.trees.clear()
        self._last = None
        return self.call(args)

    def _shape_warning(self, key: Any) -> str:
        changing = _changing_dims([*self.shape_keys, key])
        return (f"input shapes changed more than max_shapes_per_function="
                f"{self.config.max_shapes_per_function} times ({changing} kept changing)")

    # ------------------------------------------------------------ introspection
    def describe(self) -> str:
        n = sum(len(nodes) for by_key in self.trees.values() for nodes in by_key.values())
        state = (f"no CUDA graphs: {self.disabled}" if self.disabled
                 else f"{n} nodes in {len(self.trees)} trees, {len(self.shape_keys)} shapes")
        reasons = ", ".join(f"{n} {why}" for why, n in self.record_reasons.items())
        return (f"function {self.name} ({self.kind}): {state}" + (" copy-out" if self.copy_out else "")
                + (f"; recordings: {reasons}" if reasons else "")
                + (f"; inputs {sorted(self.copied)} copied after they moved" if self.copied else ""))


def skip(name: str, reason: str) -> None:
    """R7: count one skip and say why, once per function; CPU inputs (expected on a CPU machine,
    and true of every graph there) once per process, at INFO."""
    counters.bump("cudagraph_skips")
    if reason == skips.CPU_INPUTS:
        log_once(log, "skip:cpu", "cgtrees: graphs with CPU inputs (first: %s) run without CUDA graphs",
                 name, level=logging.INFO)
        return
    log_once(log, f"skip:{name}:{reason}", "cgtrees: %s runs without CUDA graphs: %s", name, reason)


def _shape_key(args: list[Any]) -> tuple:
    return tuple(tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args)


def _changing_dims(keys: list[tuple]) -> str:
    """Name the (input, dimension) pairs whose sizes differ between keys."""
    found = []
    for i, column in enumerate(zip(*keys)):
        if isinstance(column[0], tuple):
            for d, sizes in enumerate(zip(*[c for c in column if isinstance(c, tuple)])):
                if len(set(sizes)) > 1:
                    found.append(f"input {i} dimension {d}")
        elif len(set(map(repr, column))) > 1:
            found.append(f"input {i} (a size argument)")
    return ", ".join(found) or "the input shapes"


def _give_back_cached_memory() -> None:
    """Hand the default pool's free segments back to the driver, and the eager cuBLAS workspaces:
    cuBLAS keeps one (32 MiB on an H100) per handle and stream, made by a warmup's first matmul on
    its thread; every later matmul of the graph runs inside a recording, with its own, so the eager
    one would stay allocated for nothing (measured: 64 MiB of a training step's peak, one workspace
    for the forward's thread and one for autograd's)."""
    with recording_lock:  # not while another thread captures
        if compat.clear_cublas_workspaces is not None:
            compat.clear_cublas_workspaces()
        torch.cuda.empty_cache()  # every device's cache: one call
