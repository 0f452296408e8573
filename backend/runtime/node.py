"""One recorded CUDA graph (a node of a tree): how it was recorded, and its replay path.

Invariants:
- ``protected`` is the set of pool storages (data pointer, bytes) that were live when the graph was
  captured. The allocator never handed their blocks to the capture, so every byte the graph writes
  lies outside them: replaying is safe exactly when every live pool output is in ``protected``.
- Inputs are read in one of two ways, fixed at record time: *checked* inputs (static inputs,
  mutated inputs and large ones at a stable address (``function``: a KV cache, written where it
  is; a batch or gradient passed at one address), and inputs that already live in the pool)
  are read where they are, and the replay only compares their addresses (one C call); every other
  tensor input is *copied* into an input slot. A slot is pool memory allocated inside the capture
  and freed there at its last read (the graph may reuse it), so copying into its address is a
  write of this graph; mutated and broadcast inputs keep a slot of their own outside the pool, and
  mutated ones are written back. A checked input the program made (static, or mutated where it
  is) ties the graph to its storage: when that storage is gone, so is the graph (``orphaned``).
- A backward's checked pool inputs (the activations its forward saved) that die inside its capture
  are *consumed*: the graph reuses their memory, so it replays only when autograd keeps no graph and
  each of them is held by the call alone: its storage, its TensorImpl and its Python object have
  the uses and references they had when it died in the capture (a program that kept the tensor,
  through ``grad_fn.saved_tensors`` or a saved-tensors hook, holds the same TensorImpl and storage
  but adds a reference).
- Outputs are rebuilt on every replay as fresh tensors over the same pool memory (storages without
  a deleter: the pool, not the tensor, owns the memory), except a forward's saved activations: each
  replay hands out the tensors of the last one, which nobody else can hold then (``liveness``:
  their entries are idle, or the node would not fit); a recording forgets them first. Outputs
  that alias an input are rebuilt as views of that input; non-tensor outputs are constants of
  the recording. Outputs that shared one storage when recorded share one on every replay, also
  in copy-out mode (each pool storage is copied once and every output is rebuilt over its copy),
  so aliasing is eager's.
- The allocator checkpoint is taken right after the first replay, while the outputs and every
  protected storage are alive: restoring it gives back exactly those blocks (R5).
"""

from __future__ import annotations

import enum
import itertools
import sys
import weakref
from typing import Any

import torch

from cgtrees.compiled import GraphFacts
from cgtrees.context import GraphContext
from cgtrees.runtime import compat, first_calls, liveness
from cgtrees.runtime.liveness import LiveOutput, Origin, WeakStorage
from cgtrees.runtime.pool import Pool


class Fit(enum.Enum):
    """Whether a node may replay now (the hot path tests ``node.fits(...) is FIT_OK``)."""

    OK = "ok"
    MOVED = "moved"  # a checked input is at another address than when recorded
    LIVE = "live"  # a live pool output lies in memory this graph writes


class Out(enum.IntEnum):
    """How an output is rebuilt on replay."""

    POOL = 0  # over its pool storage
    INPUT = 1  # as a view of an input
    CONST = 2  # a non-tensor constant of the recording


_POOL, _INPUT, _CONST = Out.POOL, Out.INPUT, Out.CONST  # module constants: read on the hot path
_OK, _MOVED, _LIVE = Fit.OK, Fit.MOVED, Fit.LIVE
FIT_OK = _OK  # for the function's hot path: a module constant, read without an attribute lookup
_ids = itertools.count()
dead = liveness.dead


def _meta(t: torch.Tensor) -> dict[str, Any]:
    return {"size": t.size(), "stride": t.stride(), "storage_offset": t.storage_offset(),
            "dtype": t.dtype, "device": t.device, "nbytes": t.untyped_storage().nbytes(),
            "data_ptr": t.untyped_storage().data_ptr()}


def _holds(t: torch.Tensor) -> tuple[int, int]:
    """Who holds ``t``: its TensorImpl's uses and its Python object's references (read alike at a
    recording and a replay, whose frames hold the argument list and not the tensor)."""
    return compat.tensor_use_count(t), sys.getrefcount(t)


def _held(args: list[Any], holds: tuple[tuple[int, tuple[int, int]], ...], entry: LiveOutput) -> bool:
    """Whether a program holds an input over a consumed storage besides the call (``holds``: each
    input over it and its ``_holds`` at the recording): its TensorImpl (another graph's saved
    tensor) or its Python object (``grad_fn.saved_tensors`` kept, a saved-tensors hook that keeps
    it). Neither shows in the storage's use count. A tensor the forward hands out again
    (``entry.cached``) has its entry's reference too."""
    for i, (uses, refs) in holds:
        if _holds(args[i]) != (uses, refs + (args[i] is entry.cached)):
            return True
    return False


def marked_static(i: int, a: torch.Tensor, static: frozenset[int]) -> bool:
    """Whether input ``i`` is static by what the program says of it: AOTAutograd's static inputs,
    parameters, tensors marked with ``torch._dynamo.mark_static_address``."""
    return (i in static or isinstance(a, torch.nn.Parameter)
            or getattr(a, "_dynamo_static_input_type", None) is not None)


def read_in_place(i: int, a: torch.Tensor, static: frozenset[int], live_ptrs: set[int],
                  copied: frozenset[int] = frozenset()) -> bool:
    """Whether a recording reads input ``i`` where it is (a static input, one at a stable address
    (``static`` holds both), or a live pool output) rather than copying it into a slot on every
    replay. ``copied``: inputs whose address changed from call to call: copied whatever they are."""
    if a.untyped_storage().data_ptr() in live_ptrs:
        return True
    return i not in copied and marked_static(i, a, static)


def copied_bytes(args: list[Any], static: frozenset[int], live_ptrs: set[int],
                 copied: frozenset[int] = frozenset()) -> int:
    """The bytes a replay would copy into input slots, were the graph recorded on ``args`` now."""
    total = 0
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and not read_in_place(i, a, static, live_ptrs, copied):
            index = _unexpanded(a)
            total += (a if index is None else a[index]).numel() * a.element_size()
    return total


def _unexpanded(t: torch.Tensor) -> tuple | None:
    """Index that keeps one element along each broadcast (stride-0) dimension, or None."""
    if all(st != 0 or sz <= 1 for sz, st in zip(t.shape, t.stride())):
        return None
    return tuple(slice(0, 1) if (st == 0 and sz > 1) else slice(None) for sz, st in zip(t.shape, t.stride()))


def _is_whole(base: torch.Tensor | None, view: tuple) -> bool:
    """Whether an output over an input's memory is that input itself (its size, strides and first
    element): the graph returned the input, and so does a replay. Compiled autograd tells saved
    tensors apart by identity: a parameter saved for the backward must stay the parameter."""
    return base is not None and view[2] == 0 and view[0] == base.size() and view[1] == base.stride()


def _view_of(base: torch.Tensor, view: tuple | None) -> torch.Tensor:
    """An output rebuilt over the caller's input: the input itself, or a view of it."""
    return base if view is None else base.as_strided(view[0], view[1], base.storage_offset() + view[2])


class GraphNode:
    """A recorded graph of one function, for one input shape, around one set of live outputs."""

    def __init__(self, ctx: GraphContext, facts: GraphFacts, pool: Pool, parent: "GraphNode | None",
                 protected: frozenset[tuple[int, int]], copy_out: bool) -> None:
        self.id = next(_ids)
        self.function_name = ctx.name
        self.kind = ctx.kind
        self.saved_from = ctx.saved_from
        self.origin = Origin(ctx.name, ctx.kind, facts)  # what an invalidated output's error names
        self.pool = pool
        self.parent_id = None if parent is None else parent.id
        self.protected = protected
        self.copy_out = copy_out  # outputs are cloned out of the pool (R2's bound was reached)
        self.generation = pool.generation
        self.device = torch.device("cuda", pool.device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.replays = 0
        self.key: Any = None
        self.reason = "a new shape"  # why it was recorded (``GraphFunction``; the picture shows it)
        self.keeps_tensors = ctx.kind == "backward"  # what a backward returned is kept by weak reference (R4)
        self.reuse_plan: list[tuple[int, int]] = []  # set by _plan_reuse once the outputs are known
        self.reused: list[LiveOutput | None] = []

    # ---------------------------------------------------------------- record
    def record(self, call: Any, args: list[Any], static: frozenset[int], mutated: tuple[int, ...],
               live_ptrs: set[int], stable: frozenset[int] = frozenset(),
               copied: frozenset[int] = frozenset(), device_scalars: tuple[int, ...] = ()) -> list[Any]:
        """Capture ``call`` on ``args``, replay it once, checkpoint; returns this call's outputs.
        ``stable``: inputs read (mutated ones: written) where they are, at a stable address
        (``static``: the inputs the program marks); ``copied``: inputs copied into slots whatever they are;
        ``device_scalars``: CPU 0-d inputs, copied into device slots of their own."""
        self._plan_inputs(args, static, live_ptrs, mutated, stable, copied, device_scalars)
        try:
            outs = self._capture(call, args)  # the graph; outputs are pool tensors
        except BaseException:
            self._take_back(args)  # the caller runs the graph eagerly on them
            raise
        self._settle_handoff()
        self._view_pool_slots()
        for i, slot in self.scalar_slots:
            slot.copy_(args[i])
        self._copy_in(args)
        self.graph.replay()  # this call's results
        self._write_back(args)
        self._plan_outputs(outs, args)  # how each output is rebuilt on replay
        # Outputs that alias a copied input are rebuilt from the caller's input: the capture's own
        # (over a pool slot) go now, so a slot they held is free in the checkpoint, as in the graph.
        outs = [None if kind == _INPUT and self.check_ptrs[a] is None else o
                for o, (kind, a, _) in zip(outs, self.out_plan)]
        self.checkpoint = compat.get_checkpoint_state(self.pool.device, self.pool.pool)
        consumed = {p for p, _ in self.consumed}  # free in the checkpoint (unless an output took it)
        self.checkpoint_ptrs = tuple(dict.fromkeys([p for p, _ in self.protected if p not in consumed]
                                                   + [p for p, _ in self.pool_storages]))
        return self._first_outputs(outs, args)

    def _plan_inputs(self, args: list[Any], static: frozenset[int], live_ptrs: set[int], mutated: tuple[int, ...],
                     stable: frozenset[int] = frozenset(), copied: frozenset[int] = frozenset(),
                     device_scalars: tuple[int, ...] = ()) -> None:
        # the caller's CPU scalars: an 8-byte host-to-device copy each, before the graph
        self.scalar_slots = [(i, torch.empty((), dtype=args[i].dtype, device=self.device)) for i in device_scalars]
        scalars = set(device_scalars)
        self.check_index: list[int] = []
        self.static_index: list[int] = []  # the checked inputs that are not pool outputs
        self.static_storages: list[WeakStorage] = []  # theirs, to see when their model is gone
        self.check_ptrs: list[int | None] = [None] * len(args)
        self.copy_index: list[int] = []
        self.slots: list[torch.Tensor | None] = []  # None: a pool slot, allocated in the capture
        self.copy_dst: list[torch.Tensor | None] = []
        self.copy_src: list[tuple[int, tuple | None]] = []
        self.pool_slots: list[tuple[int, dict[str, Any], WeakStorage]] = []  # (slot, meta, storage)
        self.input_storages: dict[int, tuple[int, int]] = {}  # storage pointer -> (input, offset)
        # A backward's pool inputs (the activations its forward saved): handed to the capture
        # (``_capture_args``); those that die in it are *consumed*: by key, the storage's use count
        # and, for each input over it, its ``_holds`` (all that ``fits`` reads for it, one lookup).
        self.handoff: list[int] = []
        self.handed: list[tuple[tuple[int, int], WeakStorage, int]] = []
        self.handed_args: list[tuple[int, dict[str, Any]]] = []  # (input, meta) until the capture ended
        self.handed_holds: list[tuple[int, tuple[int, int]]] = []  # (input, _holds) before the capture
        self.consumed: dict[tuple[int, int], tuple[int, tuple[tuple[int, tuple[int, int]], ...]]] = {}
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor) or i in scalars:
                continue
            if read_in_place(i, a, static | stable, live_ptrs, copied):
                if a.untyped_storage().data_ptr() not in live_ptrs:
                    self.static_index.append(i)
                    if marked_static(i, a, static) or i in mutated:  # when it is gone, so is the graph
                        self.static_storages.append(WeakStorage(a.untyped_storage()))
                elif self.kind == "backward" and not self.copy_out:
                    self.handoff.append(i)
                self.check_index.append(i)
                self.check_ptrs[i] = a.data_ptr()
                self.input_storages.setdefault(a.untyped_storage().data_ptr(), (i, a.storage_offset()))
                continue
            index = _unexpanded(a)
            self.copy_index.append(i)
            self.copy_src.append((i, index))
            if index is None and i not in mutated and a.numel() > 0:
                self.slots.append(None)  # in the pool: the graph may reuse it once read (_capture_args)
                self.copy_dst.append(None)
                continue
            # a slot of its own, outside the pool: written back after the graph (a mutated input),
            # or holding one element per broadcast dimension
            slot = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
            self.slots.append(slot)
            self.copy_dst.append(slot if index is None else slot[index])
            self.input_storages.setdefault(slot.untyped_storage().data_ptr(), (i, slot.storage_offset()))
        self.write_back = [(i, self.slots[self.copy_index.index(i)]) for i in mutated if i in self.copy_index]

    def _capture_args(self, args: list[Any]) -> list[Any]:
        """The capture's arguments: checked inputs as they are, copied ones as their slots. Called
        inside the capture, so the pool slots are blocks of the pool that only the returned list
        holds: the graph frees each at its last read and may reuse its memory for what it computes
        later (an input the size of the output costs nothing). Replays copy into the slot's
        address, which is memory this graph writes: ``protected`` never covers it."""
        hand_off = bool(self.handoff) and not compat.keep_graph() and compat.tensor_use_count is not None
        if hand_off:  # before the list below holds them too
            self.handed_holds = [(i, _holds(args[i])) for i in self.handoff]
        capture_args = list(args)
        for i, slot in self.scalar_slots:
            capture_args[i] = slot
        for k, i in enumerate(self.copy_index):
            slot = self.slots[k]
            if slot is None:
                a = args[i]
                slot = torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device)
                self.pool_slots.append((k, _meta(slot), WeakStorage(slot.untyped_storage())))
            capture_args[i] = slot
        if hand_off:
            self._hand_off(args)
        return capture_args

    def _hand_off(self, args: list[Any]) -> None:
        """Let the capture hold a backward's pool inputs alone, so that it frees each at its last
        read and reuses the memory, as an eager backward would (a training step's peak). Only where
        autograd keeps no graph (no ``retain_graph``): nothing reads the activations afterwards.
        ``fits`` replays such a node only when the same holds again: the graph keeps nothing, and
        each consumed storage and each input over it are held as they were here (by the call's
        arguments alone: what dies in the capture, nobody else held)."""
        seen: set[tuple[int, int]] = set()
        self.handed_args = [(i, _meta(args[i])) for i in self.handoff]
        for i in self.handoff:
            storage = args[i].untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                weak = WeakStorage(storage)
                del storage  # a Python storage object counts as a use
                self.handed.append((key, weak, compat.storage_use_count(weak.cdata)))
        for i in self.handoff:
            args[i] = None  # outputs that alias one of them are the capture's own (``_first_outputs``)

    def _settle_handoff(self) -> None:
        """After the capture: the handed inputs that died in it are consumed; their addresses are no
        input's any more (an output there is the graph's own)."""
        key_of = {i: (meta["data_ptr"], meta["nbytes"]) for i, meta in self.handed_args}
        self.consumed = {key: (count, tuple((i, holds) for i, holds in self.handed_holds if key_of[i] == key))
                         for key, storage, count in self.handed if not storage.alive()}
        self.handed = self.handed_args = self.handed_holds = []
        for ptr, _ in self.consumed:
            self.input_storages.pop(ptr, None)

    def _take_back(self, args: list[Any]) -> None:
        """After a failed capture, the inputs handed to it as tensors over their memory again (they
        own nothing). Nothing ran in the capture, and only a capture allocates in the pool, so the
        memory of those it freed still holds their values until the next recording."""
        for i, meta in self.handed_args:
            args[i] = self._unowned(meta)
        self.handed_args = self.handed_holds = []

    def _unowned(self, meta: dict[str, Any]) -> torch.Tensor:
        """A tensor over the memory ``meta`` describes that owns nothing (the pool does)."""
        return compat.tensor_from_storage(meta, compat.storage_from_pointer(meta["data_ptr"], self.device,
                                                                            meta["nbytes"]))

    def _view_pool_slots(self) -> None:
        """After the capture: each pool slot as a tensor over its address that owns nothing; a slot
        still alive is one an output aliases (rebuilt from the caller's input)."""
        for k, meta, storage in self.pool_slots:
            self.slots[k] = self.copy_dst[k] = self._unowned(meta)
            if storage.alive():  # else its address may be an output's now: never taken for an alias
                self.input_storages.setdefault(meta["data_ptr"], (self.copy_index[k], 0))
        self.pool_slots = []
        # the cheapest copy for the common case of one plain input
        single = len(self.copy_src) == 1 and self.copy_src[0][1] is None
        self.single_index = self.copy_src[0][0] if single else -1
        self.single_slot = self.copy_dst[0] if single else None
        # one multi-tensor copy per dtype: inputs of mixed dtypes take foreach's copy of one tensor
        # at a time (alone on an H200's host, tensors of the shapes of HF's decode inputs, two int64
        # and a bool: 17 us, 12 grouped; inside a replay, host noise hides the difference)
        groups: dict[torch.dtype, tuple[list[torch.Tensor], list[tuple[int, tuple | None]]]] = {}
        for dst, src in zip(self.copy_dst, self.copy_src):
            dsts, srcs = groups.setdefault(dst.dtype, ([], []))
            dsts.append(dst)
            srcs.append(src)
        self.copy_groups = list(groups.values())

    def _copy_in(self, args: list[Any]) -> None:
        if self.single_slot is not None:
            self.single_slot.copy_(args[self.single_index])
        elif self.copy_dst:
            for dsts, srcs in self.copy_groups:
                torch._foreach_copy_(dsts, [args[i] if index is None else args[i][index] for i, index in srcs])

    def _write_back(self, args: list[Any]) -> None:
        for i, slot in self.write_back:
            args[i].copy_(slot)

    def _capture(self, call: Any, args: list[Any]) -> list[Any]:
        pool = self.pool
        first_calls.wait()  # a warm load's thread of library calls, done before any capture
        torch.cuda.synchronize(pool.device)
        # cuBLAS keeps a workspace per stream; allocated inside the capture, it is graph scratch
        if compat.clear_cublas_workspaces is not None:
            compat.clear_cublas_workspaces()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(pool.device), torch.cuda.graph(
                graph, pool=pool.pool, stream=pool.stream, capture_error_mode="thread_local"):
            outs = call(self._capture_args(args))
        if compat.clear_cublas_workspaces is not None:
            compat.clear_cublas_workspaces()
        self.graph = graph
        self.graph_replay = compat.graph_replayer(graph)
        self.returns_list = isinstance(outs, (list, tuple))
        return list(outs) if self.returns_list else [outs]

    def _plan_outputs(self, outs: list[Any], args: list[Any]) -> None:
        self.out_plan: list[tuple[Out, Any, Any]] = []
        self.pool_storages: list[tuple[int, int]] = []
        self.metas: list[dict[str, Any]] = []
        storage_index: dict[int, int] = {}
        for o in outs:
            if not isinstance(o, torch.Tensor) or o.untyped_storage().data_ptr() == 0:
                self.out_plan.append((_CONST, o, None))
                continue
            ptr = o.untyped_storage().data_ptr()
            if ptr in self.input_storages:  # a view of an input: rebuilt from that input
                i, base_offset = self.input_storages[ptr]
                view = (o.size(), o.stride(), o.storage_offset() - base_offset)
                self.out_plan.append((_INPUT, i, None if _is_whole(args[i], view) else view))
                continue
            if ptr not in storage_index:
                storage_index[ptr] = len(self.pool_storages)
                self.pool_storages.append((ptr, o.untyped_storage().nbytes()))
            self.out_plan.append((_POOL, storage_index[ptr], _meta(o)))
            self.metas.append(_meta(o))
        # the fast path: every output owns one pool storage, in order
        self.simple = (all(kind == _POOL for kind, _, _ in self.out_plan)
                       and len(self.pool_storages) == len(self.out_plan))
        # per pool storage, the outputs that live in it (the first names it in errors): _track's
        # lists, precomputed (made per replay, a scan of every output per storage cost a
        # mobilenet_v3_small backward 1.7 ms a call)
        self.outputs_in: list[list[int]] = [[] for _ in self.pool_storages]
        for j, (kind, s, _) in enumerate(self.out_plan):
            if kind == _POOL:
                self.outputs_in[s].append(j)
        self.first_output_of = [js[0] for js in self.outputs_in]
        self._plan_reuse()

    def _plan_reuse(self) -> None:
        """Which outputs replays hand out as the same tensor every time: a forward's saved
        activations (its outputs from ``ctx.saved_from`` on, which only autograd's saved tensors
        see) that own one pool storage alone. Building a tensor, its storage and its entry costs
        about 3.5 us an output (H100), paid for hundreds of them on every training step. The other
        outputs are rebuilt on each replay from ``fresh_*``."""
        start = self.saved_from
        self.reuse_plan = []  # (output, pool storage)
        if (start is not None and self.kind == "forward" and not self.copy_out
                and compat.tensor_use_count is not None):
            self.reuse_plan = [(j, s) for j, (kind, s, _) in enumerate(self.out_plan)
                               if j >= start and kind == _POOL and len(self.outputs_in[s]) == 1]
        self.reused = [None] * len(self.reuse_plan)
        self.simple = self.simple and not self.reuse_plan  # its fast path builds every output
        reused = {s for _, s in self.reuse_plan}
        fresh = [s for s in range(len(self.pool_storages)) if s not in reused]
        position = {s: k for k, s in enumerate(fresh)}
        self.fresh_keys = [self.pool_storages[s] for s in fresh]
        self.fresh_first = [self.first_output_of[s] for s in fresh]
        self.fresh_plan = [(j, kind, position[a] if kind == _POOL else a, b)
                           for j, (kind, a, b) in enumerate(self.out_plan) if not (kind == _POOL and a in reused)]

    def _first_outputs(self, outs: list[Any], args: list[Any]) -> list[Any]:
        if self.copy_out:  # one copy of each pool storage: outputs that share one still do
            return self._rebuild(args, [outs[self.first_output_of[s]].untyped_storage().clone()
                                        for s in range(len(self.pool_storages))])
        result = []
        for o, (kind, a, b) in zip(outs, self.out_plan):
            if kind == _INPUT and o is None:  # of a copied input: the caller's (a checked one's is)
                o = _view_of(args[a], b)
            result.append(o)
        storages: dict[int, torch.UntypedStorage] = {}
        for o, (kind, s, _) in zip(result, self.out_plan):
            if kind == _POOL:
                storages.setdefault(s, o.untyped_storage())
        self._track([storages[s] for s in range(len(self.pool_storages))], result, self.pool_storages,
                    self.first_output_of)
        return result

    # ---------------------------------------------------------------- replay
    def fits(self, args: list[Any], live: list[LiveOutput]) -> Fit:
        """Whether this graph may replay on ``args`` now. ``live`` may hold dead entries (a
        backward's call is not swept): a test that fails on one asks whether it is dead, and
        passes over it if so."""
        if self.check_index and not compat.ptrs_equal(args, self.check_ptrs, self.check_index):
            return _MOVED
        protected = self.protected
        consumed = self.consumed
        if consumed:  # the graph reuses these inputs' memory: only the call may hold them
            if compat.keep_graph():
                return _LIVE
            use_count = compat.storage_use_count
            for entry in live:
                key = entry.key
                if key not in protected:
                    if dead(entry):
                        continue
                    return _LIVE
                held = consumed.get(key)
                if held is not None and (use_count(entry.cdata) != held[0] or _held(args, held[1], entry)):
                    if dead(entry):
                        continue
                    return _LIVE
            return _OK
        for entry in live:
            if entry.key not in protected and not dead(entry):
                return _LIVE
        return _OK

    def static_moved(self, args: list[Any]) -> bool:
        """Whether a static input (not a pool output) is at another address than when recorded."""
        return bool(self.static_index) and not compat.ptrs_equal(args, self.check_ptrs, self.static_index)

    def moved_inputs(self, args: list[Any]) -> set[int]:
        """The static inputs (not pool outputs) at another address than when recorded."""
        return {i for i in self.static_index if args[i].data_ptr() != self.check_ptrs[i]}

    def orphaned(self) -> bool:
        """Whether a static input this graph reads (a parameter) no longer exists: its model was
        deleted, so the graph can never replay again (a new model's parameters are elsewhere)."""
        return any(not s.alive() for s in self.static_storages)

    def replay(self, args: list[Any]) -> Any:
        """The hot path: copy inputs, replay, rebuild outputs. Everything else was precomputed."""
        if self.scalar_slots:
            for i, slot in self.scalar_slots:
                slot.copy_(args[i])
        if self.single_slot is not None:
            self.single_slot.copy_(args[self.single_index])
        elif self.copy_dst:
            self._copy_in(args)
        self.graph_replay()
        if self.write_back:
            self._write_back(args)
        self.replays += 1
        outs = self._outputs(args)
        args.clear()
        return outs if self.returns_list else outs[0]

    def _outputs(self, args: list[Any]) -> list[Any]:
        """This replay's outputs: new tensors over the pool storages (``fresh_keys``), views of
        inputs and constants; a forward's saved activations are last replay's tensors."""
        device = self.device
        storages = [compat.storage_from_pointer(p, device, n) for p, n in self.fresh_keys]
        if self.copy_out:  # one copy of each pool storage: outputs that share one still do
            storages = [s.clone() for s in storages]
        if self.simple:
            tensor_from_storage = compat.tensor_from_storage
            outs = [tensor_from_storage(m, s) for m, s in zip(self.metas, storages)]
        else:
            outs = self._rebuild(args, storages)
        if not self.copy_out:
            self._track(storages, outs, self.fresh_keys, self.fresh_first)
        if self.reuse_plan:
            self._reuse(outs)
        return outs

    def _reuse(self, outs: list[Any]) -> None:
        """The saved activations: last replay's tensors (``fits`` replays only when none of them is
        live: each is idle, held by its entry alone), built on a node's first replay and after a
        tensor was invalidated or forgotten."""
        live = self.pool.live
        reused = self.reused
        for k, (j, s) in enumerate(self.reuse_plan):
            entry = reused[k]
            if entry is None or entry.cached is None:
                entry = reused[k] = self._reusable(j, s)
            outs[j] = entry.cached
            live.append(entry)

    def _reusable(self, j: int, s: int) -> LiveOutput:
        """A new tensor over pool storage ``s`` (no deleter: the pool owns the memory), kept by its entry."""
        ptr, nbytes = self.pool_storages[s]
        storage = compat.storage_from_pointer(ptr, self.device, nbytes)
        tensor = compat.tensor_from_storage(self.out_plan[j][2], storage)
        return liveness.keeping(storage, (ptr, nbytes), self.origin, j, tensor)

    def forget_reused(self) -> None:
        """Drop the kept tensors (before a recording restores a checkpoint, and at release): what
        someone else still holds stays live as an ordinary output."""
        for entry in self.reused:
            if entry is not None:
                entry.cached = entry.cached_storage = None
        self.reused = [None] * len(self.reuse_plan)

    def _rebuild(self, args: list[Any], storages: list[Any]) -> list[Any]:
        """Every output but the reused ones, ``storages`` being those of ``fresh_keys``."""
        outs: list[Any] = [None] * len(self.out_plan)
        tensor_from_storage = compat.tensor_from_storage
        for j, kind, a, b in self.fresh_plan:
            if kind == _POOL:
                outs[j] = tensor_from_storage(b, storages[a])
            elif kind == _INPUT:
                outs[j] = _view_of(args[a], b)
            else:
                outs[j] = a
        return outs

    def _track(self, storages: list[Any], outs: list[Any], keys: list[tuple[int, int]], first: list[int]) -> None:
        """A live entry for each storage handed out (``keys``; ``first``, the first output in each)."""
        live = self.pool.live
        origin = self.origin
        if self.keeps_tensors:  # a backward: nothing reused, so these are all of its storages
            for storage, key, js in zip(storages, keys, self.outputs_in):
                live.append(LiveOutput(storage, key, origin, js[0], [weakref.ref(outs[j]) for j in js]))
        else:
            for storage, key, j in zip(storages, keys, first):
                live.append(LiveOutput(storage, key, origin, j, None))

    # ---------------------------------------------------------------- introspection
    def describe(self) -> str:
        copied = len(self.copy_index)
        return (f"node {self.id} {self.function_name} parent={self.parent_id} gen={self.generation} "
                f"key={self.key} replays={self.replays} inputs copied={copied} checked={len(self.check_index)} "
                f"outputs={len(self.out_plan)} pool_bytes={sum(n for _, n in self.pool_storages)} "
                f"protected={len(self.protected)} consumed={len(self.consumed)} reused={len(self.reuse_plan)}"
                + (" copy-out" if self.copy_out else ""))

    def release(self, keep_graph: bool) -> None:
        """Free the input slots and, unless ``keep_graph`` (the manager's last node: its checkpoint
        is what the next recording restores, ``TreeManager.release``), the graph."""
        self.slots = self.copy_dst = self.copy_groups = []
        self.single_slot = None
        self.forget_reused()
        self.static_storages = []
        if not keep_graph:
            self.graph = self.graph_replay = None
            self.checkpoint = None
