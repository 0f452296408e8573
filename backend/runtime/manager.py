"""The tree manager: one per (device, thread of the forward); one memory pool for all its graphs.

Invariants:
- Every graph a manager records is captured into its one pool, so graphs that never hold memory at
  the same time share it: after A, the siblings B and B' take max(A+B, A+B'), not the sum.
- ``live`` lists every pool output the user may still hold (``liveness.LiveOutput``), and between
  a forward and its backward also some that died (that call is not swept). A node is replayed only
  if every live one is in its ``protected`` set (R2); otherwise a new node is recorded around them.
  The node that ran last has every live output in its checkpoint (each was live when it ran:
  either protected by it or its own output), so before recording after replays the pool's
  book-keeping is restored to that node's checkpoint (R5): live storages get their blocks back
  (with a deleter), blocks of storages that died since are freed.
- ``stale`` is True after a replay: the allocator does not know what the replay wrote, and the
  next recording must restore a checkpoint first. Right after a recording it is accurate.
- Generations (R3) end at ``torch.compiler.cudagraph_mark_step_begin()`` and at the first forward
  after a backward ran (a mark between a forward and its backward waits for that forward: the
  backward still needs the activations of its step); then what a backward produced stays live
  and protected (R4: gradients survive, and the next nodes are recorded around them) and every
  other live output is invalidated (R1). In inference nothing needs ending: outputs that die
  free their memory, outputs that live are protected.
- A backward runs under the manager of its forward (their ``SharedTree``), not its own thread's.
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import torch

from cgtrees.context import GraphKind
from cgtrees.logs import log_once
from cgtrees.runtime import compat, liveness
from cgtrees.runtime.liveness import LiveOutput
from cgtrees.runtime.node import GraphNode
from cgtrees.runtime.pool import Pool

log = logging.getLogger("cgtrees.runtime")


class TreeManager(Pool):
    def __init__(self, device: int) -> None:
        super().__init__(device)
        self.thread = threading.current_thread().name
        self.stale = False
        self.last_node: GraphNode | None = None
        # weak: a node lives as long as its function (or the last node, or a live output) holds it,
        # so the graphs of a compiled function that was freed are freed with it
        self.nodes: list[weakref.ref[GraphNode]] = []
        self.mark_seen = compat.mark_step_counter()
        self.backward_ran = False
        self.last_kind: GraphKind | None = None  # of the last call (a backward after a forward skips the sweep)
        self.closed = False
        self.invalidated = 0
        # The entries the last sweep dropped, released once the call's graph is launched
        # (``GraphFunction.__call__``), not before: each release is a microsecond or more of Python,
        # and until a step's first launch the GPU waits for the host
        self.dropped: list[LiveOutput] | None = None
        self._warmup_pool: compat.WarmupPool | None = None
        self._warmup_pool_lock = threading.Lock()

    # ------------------------------------------------------------ each call
    def begin_call(self, kind: GraphKind) -> list[LiveOutput]:
        """End the generation where R3 says so; return the pool outputs that may be live. Those a
        backward right after a forward gets are not swept: ``GraphNode.fits`` passes over the dead
        among them (its test of a live one is the sweep's), and the next forward ends the
        generation, which sweeps. Any other call gets them swept (a generation's end sweeps)."""
        counter = compat.mark_step_counter()
        last, self.last_kind = self.last_kind, kind
        if counter != self.mark_seen and kind == "backward" and last == "forward" and not self.backward_ran:
            # The mark came between a forward and its backward: ending the step here would take the
            # activations the backward reads. The step ends at the next forward, as after any backward.
            self.mark_seen = counter
            log_once(log, "mark-before-backward", "cgtrees: torch.compiler.cudagraph_mark_step_begin() was "
                     "called between a forward and its backward; the step ends at the next forward instead "
                     "(call it before the forward)")
            swept = False
        elif counter != self.mark_seen:
            self.mark_seen = counter
            self.end_generation("torch.compiler.cudagraph_mark_step_begin()")
            swept = True
        elif kind == "forward" and self.backward_ran:
            self.end_generation("the next forward began after a backward")
            swept = True
        else:
            swept = False
        if kind == "backward":
            self.backward_ran = True
            swept = swept or last == "forward"
        live = self.live
        if live and not swept:
            alive = liveness.still_alive(live)
            if len(alive) != len(live):
                self.dropped = live
                live = self.live = alive
                if not live:
                    self.generation += 1  # inference: every output of the last step died
        return live

    def end_generation(self, why: str) -> None:
        self.dropped = self.live
        self.live, invalidated = liveness.end_generation(self.live, why)
        self.invalidated += invalidated
        self.generation += 1
        self.backward_ran = False
        self.release_warmup_pool()

    def after_replay(self, node: GraphNode) -> None:
        """Before ``node`` replays. The storages it consumes (a backward's saved activations, held
        by the call alone: ``fits``) are dead once it returns: their entries go now, before the
        replay's own outputs, which may lie at the same addresses, are tracked."""
        self.stale = True
        self.last_node = node
        consumed = node.consumed
        if consumed:
            self.live = [e for e in self.live if e.key not in consumed]

    # ------------------------------------------------------------ warmup
    def warmup_pool(self) -> compat.WarmupPool:
        """The pool this tree's warmups allocate from until the next recording or generation."""
        with self._warmup_pool_lock:
            if self._warmup_pool is None:
                self._warmup_pool = compat.WarmupPool(self.device)
            return self._warmup_pool

    def release_warmup_pool(self) -> None:
        if self._warmup_pool is None:  # every step's generation end: no lock taken for nothing
            return
        with self._warmup_pool_lock:
            pool, self._warmup_pool = self._warmup_pool, None
        if pool is not None:
            pool.release()

    # ------------------------------------------------------------ recording
    def prepare_recording(self) -> list[LiveOutput]:
        """Make the allocator's book-keeping for the pool true again (R5); return the live outputs."""
        self.release_warmup_pool()  # the capture empties the cache: its free segments go back
        # Reused tensors (saved activations) are forgotten first: what someone else holds stays
        # live as an ordinary output, which the checkpoint below may give a deleter.
        for node in self.alive_nodes():
            node.forget_reused()
        # Outputs that died in a reference cycle still answer their weak references: they count as
        # live, which is safe (their blocks stay allocated until the cycle is collected) but may
        # cost a branch. The young generations hold the cycles of the last calls and take well
        # under a millisecond; a full collection took 0.13-0.18 s a recording (measured on the
        # H200 with torch's modules loaded) and is not worth it.
        gc.collect(1)
        live = self.live = liveness.still_alive(self.live)
        if self.stale and self.last_node is not None:
            node = self.last_node
            without_deleter = [e.cdata for e in live if not compat.has_standard_deleter(e.cdata)]
            compat.restore_checkpoint(self.device, node.checkpoint, without_deleter)
            live_ptrs = {e.key[0] for e in live}
            for ptr in node.checkpoint_ptrs:
                if ptr not in live_ptrs:
                    compat.raw_delete(ptr)  # live at the checkpoint, dead now
        self.stale = False
        return live

    def after_recording(self, node: GraphNode) -> None:
        self.nodes = [ref for ref in self.nodes if ref() is not None]
        self.nodes.append(weakref.ref(node))
        self.last_node = node
        self.stale = False

    # ------------------------------------------------------------ reset / describe
    def close(self) -> None:
        """Invalidate what is live (copying out gradients), drop every graph (the pool goes with them)."""
        live, self.live = self.live, []
        self.dropped = None
        liveness.release_all(live, "cgtrees reset()")
        self.release_warmup_pool()
        self.last_node = None
        for node in self.alive_nodes():
            node.release(keep_graph=False)
        self.nodes.clear()
        self.closed = True

    def release(self, node: GraphNode) -> None:
        """Free a node's input slots and, unless it is the last node, its graph: the last node's
        checkpoint is what the next recording restores (R5), and torch restores a pool's checkpoint
        only while a graph still uses the pool."""
        node.release(keep_graph=node is self.last_node)

    def alive_nodes(self) -> list[GraphNode]:
        return [node for node in (ref() for ref in self.nodes) if node is not None]

    def pool_bytes(self) -> int:
        try:
            segments = torch.cuda.memory_snapshot()
        except Exception:  # noqa: BLE001 - introspection only
            return -1
        pool = tuple(self.pool)
        return sum(s.get("total_size", 0) for s in segments if tuple(s.get("segment_pool_id", ())) == pool)

    def describe(self) -> str:
        lines = [f"tree cuda:{self.device} thread={self.thread} generation={self.generation} "
                 f"nodes={len(self.alive_nodes())} live_outputs={len(liveness.still_alive(self.live))} "
                 f"pool_bytes={self.pool_bytes()} invalidated={self.invalidated}"]
        lines += ["  " + node.describe() for node in self.alive_nodes()]
        return "\n".join(lines)


class SharedTree:
    """What a forward and its backward share at run time: the tree manager the forward last ran
    under, which the backward uses (autograd runs it on its own device thread)."""

    __slots__ = ("manager",)

    def __init__(self) -> None:
        self.manager: TreeManager | None = None


class Managers:
    """Managers by (device, thread); the hot path finds its own through a thread-local dict."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._all: list[TreeManager] = []
        self._local = _ByDevice()

    def current(self, device: int) -> TreeManager:
        mine = self._local.by_device
        manager = mine.get(device)
        if manager is None or manager.closed:
            manager = mine[device] = TreeManager(device)
            with self._lock:
                self._all.append(manager)
        return manager

    def all(self) -> list[TreeManager]:
        with self._lock:
            return [m for m in self._all if not m.closed]

    def close_all(self) -> None:
        with self._lock:
            managers, self._all = self._all, []
        for manager in managers:
            if not manager.closed:
                manager.close()


class _ByDevice(threading.local):
    """This thread's managers, by device."""

    def __init__(self) -> None:
        self.by_device: dict[int, TreeManager] = {}
