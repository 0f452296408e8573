"""Which pool outputs the user still holds, and what happens to them when a generation ends.

Invariants:
- Every storage of pool memory we hand out (from a recording or a replay) is tracked by one
  ``LiveOutput`` holding a weak reference to its StorageImpl. It is *live* while anything (the
  tensor we returned, a view of it, autograd's saved tensors) keeps the storage alive.
- A live output is never overwritten (R2): the node chooser replays a graph only if every live
  output is one that graph was recorded around (``GraphNode.protected``).
- When a generation ends, what a backward produced stays live and protected (gradients survive,
  R4); every other live output is invalidated: its memory goes back to the pool and every later
  access raises a RuntimeError that names the function, the op and the remedy (R1).
- ``reset()`` frees the pool: gradients we still hold are copied out in place, the rest invalidated.
- A forward's saved activations are handed out as the same tensors on every replay (``cached``):
  the entry keeps its tensor, and that reference does not count. A cached entry is live while
  anything else holds the tensor (its Python object or its TensorImpl) or its storage; an *idle*
  one (held by the entry alone) is dead for every rule above, and reusing its tensor is then
  indistinguishable from building a new one. An entry whose tensor is invalidated drops it.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch

from cgtrees.compiled import GraphFacts
from cgtrees.runtime import compat


@dataclass(frozen=True)
class Origin:
    """Which function's graph handed out a pool output: what R1's error names."""

    function: str
    kind: str  # forward, backward or inference
    facts: GraphFacts  # the op and source line behind each output


class WeakStorage:
    """A weak reference to a StorageImpl: whether anything still holds the storage (a static
    input's parameter, a pool output the user kept)."""

    __slots__ = ("cdata", "_free")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.cdata = storage._weak_ref()
        self._free = torch.UntypedStorage._free_weak_ref  # kept: torch may be gone at shutdown

    def alive(self) -> bool:
        return compat.storage_use_count(self.cdata) > 0

    def __del__(self) -> None:
        self._free(self.cdata)


class _Holder:
    __slots__ = ("cached", "cached_storage")


def _idle_refcounts() -> tuple[int, int]:
    """What ``sys.getrefcount`` reads in ``idle`` for a kept tensor and its storage's Python object
    that only an entry holds (torch 2.13's storage holds its Python object once it has one). Real
    tensors even when this module is first imported under a fake mode (a compile's)."""
    probe = _Holder()
    with compat.outside_dispatch_modes():
        storage = torch.UntypedStorage(16)
        probe.cached = torch.empty(0, dtype=torch.uint8).set_(storage)
    probe.cached_storage = storage
    del storage
    t, s = probe.cached, probe.cached_storage
    return sys.getrefcount(t), sys.getrefcount(s)


class LiveOutput(WeakStorage):
    """One storage of pool memory that we handed out, held by a weak reference to its StorageImpl."""

    __slots__ = ("key", "origin", "index", "tensors", "cached", "cached_storage", "idle_uses")

    def __init__(self, storage: torch.UntypedStorage, key: tuple[int, int], origin: Origin, index: int,
                 tensors: list[weakref.ref] | None) -> None:
        # WeakStorage's two fields set here, not through super().__init__: one made every replay
        self.cdata = storage._weak_ref()
        self._free = torch.UntypedStorage._free_weak_ref
        self.key = key  # (data pointer, bytes): what a node's ``protected`` set is made of
        self.origin = origin
        self.index = index  # the first output of ``origin``'s graph that lives in this storage
        self.tensors = tensors  # weak refs to the tensors a backward returned (R4), else None
        self.cached: torch.Tensor | None = None  # the tensor replays hand out again (a saved activation)
        self.cached_storage: torch.UntypedStorage | None = None  # and its storage's Python object
        self.idle_uses = 0  # the storage's use count when only the two above hold it

    def alive(self) -> bool:
        return not dead(self)


def keeping(storage: torch.UntypedStorage, key: tuple[int, int], origin: Origin, index: int,
            tensor: torch.Tensor) -> LiveOutput:
    """An entry that keeps ``tensor`` over ``storage`` (and the storage's Python object, so that a
    program holding ``tensor.untyped_storage()`` is seen) to hand out again. Called while nothing
    else holds them: the storage's use count now is its idle count (the tensor's, and the Python
    object's, which torch 2.13 keeps for the life of the storage once it exists)."""
    entry = LiveOutput(storage, key, origin, index, None)
    entry.cached = tensor
    entry.cached_storage = storage
    entry.idle_uses = compat.storage_use_count(entry.cdata)
    return entry


_IDLE_TENSOR_REFS, _IDLE_STORAGE_REFS = _idle_refcounts()


def dead(entry: LiveOutput) -> bool:
    """Whether nothing but the runtime holds the entry's storage (the hot path's liveness test).
    ``still_alive`` and ``end_generation`` inline the same test: change the three alike."""
    uses = compat.storage_use_count(entry.cdata)
    return uses == 0 or (uses <= entry.idle_uses and entry.cached is not None and idle(entry))


def idle(entry: LiveOutput) -> bool:
    """Whether the tensor an entry keeps, and its storage's Python object, are held by the entry
    alone (``dead``'s second half, for an entry whose storage's use count is at its idle count)."""
    t, s = entry.cached, entry.cached_storage
    return (compat.tensor_use_count(t) == 1 and sys.getrefcount(t) == _IDLE_TENSOR_REFS
            and sys.getrefcount(s) == _IDLE_STORAGE_REFS)


def overwritten_message(origin: Origin, index: int, why: str) -> str:
    op = origin.facts.output_op(index)
    return (f"cgtrees: this tensor is output {index} of {origin.function} (produced by {op}), "
            f"replayed from a CUDA graph; its memory was reused after {why}. "
            "Clone it (out.clone()) before the next step if you need it later, or don't keep it "
            "across steps.")


def copy_out_in_place(entry: LiveOutput) -> None:
    """Move each tensor a backward returned (typically a ``.grad``) out of the pool, in place."""
    for ref in entry.tensors or ():
        t = ref()
        if t is None or t.requires_grad:
            continue
        with torch.no_grad():
            t.set_(t.clone())


def invalidate(entry: LiveOutput, why: str) -> None:
    """Give the storage's memory back to the pool; every later access raises our message."""
    entry.cached = entry.cached_storage = None
    cdata = entry.cdata
    if compat.has_standard_deleter(cdata):
        compat.free_and_remove_deleter(cdata)  # a recording's output: the allocator owns the block
    compat.set_storage_error(cdata, overwritten_message(entry.origin, entry.index, why))


def end_generation(live: list[LiveOutput], why: str) -> tuple[list[LiveOutput], int]:
    """What a backward produced stays live and protected (R4: a ``.grad``, possibly a view that
    autograd made of our output, keeps its memory; later nodes are recorded around it); the rest
    is invalidated. Returns (what stays live, how many were invalidated)."""
    kept, n = [], 0
    use_count = compat.storage_use_count
    for entry in live:  # ``dead``, inlined: this loop sees every output of a training step
        uses = use_count(entry.cdata)
        if uses == 0 or (uses <= entry.idle_uses and entry.cached is not None and idle(entry)):
            continue
        if entry.tensors is not None:
            kept.append(entry)
            continue
        invalidate(entry, why)
        n += 1
    return kept, n


def release_all(live: list[LiveOutput], why: str) -> None:
    """``reset()``: the pool goes away. Tensors a backward returned are copied out in place where
    we still hold them; whatever still points into the pool after that is invalidated."""
    for entry in live:
        if entry.tensors and entry.alive():
            copy_out_in_place(entry)
        if entry.alive():
            invalidate(entry, why)


def still_alive(live: list[LiveOutput]) -> list[LiveOutput]:
    """The entries not ``dead`` (inlined: every call of a compiled function runs this over every
    live output, a training step's saved activations included)."""
    use_count = compat.storage_use_count
    alive = []
    for entry in live:
        uses = use_count(entry.cdata)
        if uses == 0 or (uses <= entry.idle_uses and entry.cached is not None and idle(entry)):
            continue
        alive.append(entry)
    return alive
