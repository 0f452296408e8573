"""Every private torch API the runtime uses, in one place, checked against the torch we run.

Invariants:
- Nothing outside this module touches ``torch._C`` for the runtime. Names differ between releases
  (torch 2.11 with CUDA on the GPU machine, torch 2.13 CPU-only in CI); each entry below looks the
  name up once, at import, and ``missing()`` lists what the CUDA graph path needs but lacks.
- Import never fails on a CPU build: the CUDA-only entries are then ``None`` and ``supported()``
  is False, so ``wrap`` runs graphs without CUDA graphs.
- ``mark_step_counter()`` never imports ``torch._inductor.cudagraph_trees`` (about a second):
  ``cgtrees.marks`` reads that module's counter only where something imported it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Sequence

import torch

from cgtrees import marks

_C = torch._C


def _first(*names: str) -> Any:
    for name in names:
        fn = getattr(_C, name, None)
        if fn is not None:
            return fn
    return None


# Allocator checkpoints: snapshot a private pool's book-keeping, and put it back later.
get_checkpoint_state = _first("_cuda_getCheckpointState")
_set_checkpoint_pool_state = _first("_cuda_setCheckpointPoolState")
raw_delete = _first("_cuda_cudaCachingAllocator_raw_delete")
# Storages whose memory the pool owns: build one from a pointer (no deleter), give it one back.
storage_from_pointer = _first("_construct_storage_from_data_pointer")
_tensor_from_storage = _first("_construct_CUDA_Tensor_From_Storage_And_Metadata")
has_standard_deleter = _first("_has_Standard_Deleter")
free_and_remove_deleter = _first("_free_And_Remove_DeleterFn")
# Outputs whose memory was reused: every later access raises with our message.
set_storage_error = _first("_set_storage_data_ptr_access_error_msg")
storage_use_count = _first("_storage_Use_Count")
# How many at::Tensor references a TensorImpl has (its Python object's counts as one; autograd's
# saved tensors hold the TensorImpl): whether a tensor we keep is held by anyone else. Without
# it, replays build every output afresh (``node.py``, reused outputs).
tensor_use_count = getattr(torch.Tensor, "_use_count", None)
_ptrs_equal = _first("_tensors_data_ptrs_at_indices_equal")
clear_cublas_workspaces = _first("_cuda_clearCublasWorkspaces")
# A pool of its own for a warmup's eager allocations: route this thread's allocations to a new pool
# id, then release the id (torch frees its segments at its next emptying of the cache, once their
# blocks are free). Absent in an old torch: the warmup allocates from the default pool.
_begin_thread_to_pool = _first("_cuda_beginAllocateCurrentThreadToPool")
_end_to_pool = _first("_cuda_endAllocateToPool")
_release_pool = _first("_cuda_releasePool")
# Whether the running backward keeps its graph (retain_graph; True outside a backward): then the
# activations it reads are read again later, and a graph must not reuse their memory.
keep_graph = getattr(getattr(_C, "_autograd", None), "_get_current_graph_task_keep_graph", None) or (lambda: True)
_graph_task_id = _first("_current_graph_task_id")


def in_backward() -> bool:
    """Whether this thread is running a backward (an autograd graph task); False where torch cannot tell."""
    return _graph_task_id is not None and _graph_task_id() != -1


# What the CUDA graph path cannot do without (the rest has a fallback below).
_REQUIRED = {
    "_cuda_getCheckpointState": get_checkpoint_state,
    "_cuda_setCheckpointPoolState": _set_checkpoint_pool_state,
    "_cuda_cudaCachingAllocator_raw_delete": raw_delete,
    "_construct_storage_from_data_pointer": storage_from_pointer,
    "_has_Standard_Deleter": has_standard_deleter,
    "_free_And_Remove_DeleterFn": free_and_remove_deleter,
    "_set_storage_data_ptr_access_error_msg": set_storage_error,
    "_storage_Use_Count": storage_use_count,
}


def missing() -> list[str]:
    """Names the CUDA graph path needs that this torch build lacks (empty on a CUDA build)."""
    return [name for name, fn in _REQUIRED.items() if fn is None]


def supported() -> bool:
    return not missing() and torch.cuda.is_available()


def report() -> dict[str, bool]:
    """Which of the names we know about exist here (printed by the GPU test run)."""
    names = [*_REQUIRED, "_construct_CUDA_Tensor_From_Storage_And_Metadata",
             "_tensors_data_ptrs_at_indices_equal", "_cuda_clearCublasWorkspaces",
             "_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateCurrentStreamToPool",
             "_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool", "_cuda_releasePool"]
    found = {name: hasattr(_C, name) for name in names}
    found["_autograd._get_current_graph_task_keep_graph"] = hasattr(getattr(_C, "_autograd", None),
                                                                    "_get_current_graph_task_keep_graph")
    found["Tensor._use_count"] = tensor_use_count is not None
    return found


def restore_checkpoint(device: int, state: Any, give_deleters_to: Sequence[int]) -> None:
    """Put the pool's book-keeping back to ``state``; the listed storages (StorageImpl pointers,
    each without a deleter) then own their blocks, so the allocator frees them when they die."""
    _set_checkpoint_pool_state(device, state, [], list(give_deleters_to))


def tensor_set_to_storage(meta: dict[str, Any], storage: Any) -> torch.Tensor:
    """A tensor over ``storage`` as ``meta`` describes it, through public calls."""
    out = torch.empty((0,), dtype=meta["dtype"], device=meta["device"])
    return out.set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


# torch's C call itself where it exists (a replay builds hundreds of outputs: no Python frame each)
tensor_from_storage = _tensor_from_storage if _tensor_from_storage is not None else tensor_set_to_storage


def ptrs_equal(tensors: list[Any], ptrs: list[int | None], indices: list[int]) -> bool:
    """``tensors[i].data_ptr() == ptrs[i]`` for every ``i`` in ``indices`` (one C call on CUDA)."""
    if _ptrs_equal is not None:
        return _ptrs_equal(tensors, ptrs, indices)
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


# A number that moves at each ``torch.compiler.cudagraph_mark_step_begin()``: read at every call of a
# wrapped function, so the name itself, not a function that calls it (one Python frame less a call).
mark_step_counter = marks.counter


def graph_replayer(graph: torch.cuda.CUDAGraph) -> Any:
    """The C++ ``replay`` bound to ``graph`` (skips the Python wrapper) unless a tracker needs it."""
    base = getattr(_C, "_CUDAGraph", None)
    if base is not None and getattr(graph, "_tracker", None) is None:
        return base.replay.__get__(graph)
    return graph.replay


def recover_generator(device: int) -> None:
    """After a failed capture, give the default CUDA generator a fresh state that is not capturing.

    A capture that fails ends without the generator's capture epilogue, and every later random op
    would then raise "Offset increment outside graph capture". A cloned state keeps seed and offset.
    """
    try:
        gen = torch.cuda.default_generators[device]
        gen.graphsafe_set_state(gen.clone_state())
    except Exception:  # noqa: BLE001 - best effort: older builds lack graph-safe states
        pass


def outside_dispatch_modes() -> Any:
    """A context where no Python dispatch mode (a fake tensor mode the importer holds) intercepts:
    our import-time probes make real tensors."""
    import contextlib

    from torch.utils import _python_dispatch

    disable = getattr(_python_dispatch, "_disable_current_modes", None)
    return disable() if disable is not None else contextlib.nullcontext()


class WarmupPool:
    """A pool that a tree's warmups allocate from (eagerly, outside any capture) until the tree
    releases it. A forward's warmup and its backward's share its segments, as their recordings
    share the tree's pool: in pools of their own, the backward could not reuse what the forward
    freed (GPT-2 small training, H200: 6042 MiB of warmup pools at step 1 against the tree's 4680).
    Not the default pool either: there the optimizer's first state is cut from the warmup's freed
    segments and pins them (1457 MiB). Released, what is free in it, and every block freed later,
    goes back to the driver the next time the allocator empties its cache (``torch.cuda.graph``
    does, before each capture). No ``torch.cuda.MemPool``: its destructor empties the pool's cache
    on the spot, and in the GPU suite it aborted four tests' processes (two threads recording; a
    capture that fails), which ``benchmarks/probes/probe_mempool_abort.py`` does not reproduce in
    one thread.

    The gradients a backward's warmup makes stay in it: kept across steps (no ``zero_grad``, or
    ``set_to_none=False``), they keep their segments reserved. Copying them out was measured worse:
    to a pool of their own, the gradient of a graph's input (GPT-2's logits, 786 MiB) pinned that
    pool through the next backward (H200: 7472 MiB at step 1 against 6256 steady); to the default
    pool, the optimizer's state was cut between them (+554 MiB steady).

    One warmup at a time (``_lock``, held across it): the allocator ends a thread's allocation to
    a pool by the pool's id alone, so two threads in one pool at once could end each other's."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.id = torch.cuda.graph_pool_handle()
        self._lock = threading.RLock()
        self._open = _begin_thread_to_pool is not None and _end_to_pool is not None and _release_pool is not None
        if self._open:  # made, holding one reference: ours, until release()
            _begin_thread_to_pool(device, self.id)
            _end_to_pool(device, self.id)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """This thread's allocations on the device come from the pool, for the duration."""
        with self._lock:
            if not self._open:  # released (or no such API): the default pool
                yield
                return
            _begin_thread_to_pool(self.device, self.id)  # a reference of its own
            try:
                yield
            finally:
                _end_to_pool(self.device, self.id)
                _release_pool(self.device, self.id)

    def release(self) -> None:
        with self._lock:
            if self._open:
                self._open = False
                _release_pool(self.device, self.id)
