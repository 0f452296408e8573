"""first_calls: a warm load makes its kernel modules' library calls once, on empty tensors, in a
background thread, so that the first real call finds cuDNN, cuBLAS and their kernels loaded.

In a fresh process the first call of each convolution or matmul configuration is slow: the
library's handle and its own loading, then CUDA's lazy loading of each kernel it picks (about
0.5 s of a small ResNet's first training step on an H100, and 0.25 s of a transformer layer's).
Which calls a module makes is known when it is generated (``codegen.library_calls.specs``: the op,
and the size, strides, offset and dtype of each tensor argument, as its ``call`` passes them, kept
in ``CompiledGraph.library_calls``). A warm load (a level-1 hit, a precompiled function, Dynamo's
cache) hands them to ``start`` before it loads the modules,
and they are made while the main thread runs the GIL-holding Python of our load and of Dynamo's
guards (torch's ops let go of the GIL):

- the calls of forward and inference modules, in a thread that starts Triton's driver first. What
  a library keeps per process (cuDNN's and cuBLAS's loading, CUDA's lazily loaded kernels) is then
  ready for the real call; what it keeps per thread is not: cuDNN's execution plans (torch caches
  them thread-locally), costly for grouped convolutions, which are left to the real call (depthwise
  ones are generated kernels, ``lower_conv``);
- then the calls of modules that run as a backward, in the backward of a small autograd graph of
  their own, which autograd runs on its device thread: where the real backward will run and find the
  plans and handles made for it (mobilenet_v3_small's warm training start on an H200: 3.5-3.9 s
  instead of 6.8-7.3 s with every call made in one thread). The two run one after the other, so
  that their empty tensors never add up in a warm process's peak.

``wait`` joins both: before a module's first call and before a CUDA graph capture; inside a
backward it leaves the second, which may be waiting for this very thread.

Which calls are kept is ``codegen.library_calls``' rule (safe on uninitialised memory). The thread
only saves time: whatever fails in it is logged at debug level and left to the real call. A
program that captures CUDA graphs of its own around a loaded function (with our ``cudagraphs``
off) should call it once before capturing, as it would to warm it up: a capture in torch's
default (global) mode fails if another thread allocates device memory meanwhile, and the thread
runs until that first call joins it.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable, Sequence

import torch

from cgtrees import counters
from cgtrees.runtime import compat

log = logging.getLogger("cgtrees.runtime")

CONVOLUTIONS = ("aten.convolution.", "aten.convolution_backward.", "aten._convolution.")


# -------------------------------------------------------------------------------------- the format
def numel(tensor: list) -> int:
    """The elements a spec's tensor (``[size, stride, offset, dtype]``) spans in its storage."""
    size, stride, offset, _ = tensor
    if any(n == 0 for n in size):
        return 0
    return offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def op(name: str) -> Any:
    """The aten overload a spec names (``aten.mm.default``)."""
    _, packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)


# ------------------------------------------------------------------------------------------ making
def call(spec_text: str) -> Any:
    """Make one call of ``specs`` on empty tensors (on its device), and return its result."""
    return _make(json.loads(spec_text))


def _make(spec: dict[str, Any]) -> Any:
    device = torch.device(spec["device"])
    args = [_decode(a, device) for a in spec["args"]]
    kwargs = {k: _decode(v, device) for k, v in spec["kwargs"].items()}
    return op(spec["op"])(*args, **kwargs)


def _decode(value: Any, device: torch.device) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        size, stride, offset, dtype = value["tensor"]
        storage = torch.empty(numel(value["tensor"]), dtype=getattr(torch, dtype), device=device)
        return storage.as_strided(size, stride, offset)
    if isinstance(value, list):
        return [_decode(v, device) for v in value]
    return value


_pending: list[threading.Thread] = []
_made: list[int] = []  # calls each finished thread made, counted when it is joined
_started: set[str] = set()  # each configuration once per process
_driver_started = False  # Triton's driver, started in the first thread (``start``'s ``driver``)
BACKWARD_THREAD = "cgtrees-first-calls-backward"


def start(forward: Sequence[str], backward: Sequence[str] = (), driver: Callable[[], Any] | None = None) -> None:
    """Make the CUDA calls this process has not made before, in threads of their own: ``forward``,
    the calls of modules run in the caller's thread (Triton's driver started first by ``driver``,
    once per process), and ``backward``, those of modules run as a backward, on autograd's device
    thread. Nothing when there is nothing to do or no CUDA."""
    global _driver_started
    forward_calls, backward_calls = _new(forward), _new(backward)
    driver = None if _driver_started else driver
    if not (forward_calls or backward_calls or driver) or not torch.cuda.is_available():
        return
    _driver_started = _driver_started or driver is not None
    first = None
    if forward_calls or driver:
        first = _begin(_run, (_ungrouped_convolutions(forward_calls), driver), "cgtrees-first-calls")
    if backward_calls:  # after the first thread: their tensors never add up (a warm step peaks as a cold one)
        _begin(_run_in_backward, (backward_calls, first), BACKWARD_THREAD)


def _new(spec_texts: Sequence[str]) -> list[dict[str, Any]]:
    texts = [s for s in dict.fromkeys(spec_texts) if s not in _started]
    _started.update(texts)
    return [c for c in map(json.loads, texts) if c.get("device", "").startswith("cuda")]


def _ungrouped_convolutions(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """cuDNN's execution plans are cached per thread (torch's ``Conv_v8.cpp``): a plan built here
    is built again by the thread that makes the real call. For an ordinary convolution that plan is
    cheap and what this thread saves is the process's share (cuDNN's load, its kernels' lazy
    loading: 0.15 s of a channels-last 1x1 convolution's first call on an H200, 3 ms left to the
    caller). A grouped one's plan is most of its cost (0.15-0.2 s on either thread): made here it
    only keeps the caller waiting at the join, so only when a device has no other convolution (one
    loads cuDNN for the process)."""
    ungrouped = {call["device"] for call in calls if call["op"].startswith(CONVOLUTIONS) and _groups(call) == 1}
    seen: set[str] = set()
    kept = []
    for call in calls:
        if call["op"].startswith(CONVOLUTIONS) and _groups(call) != 1:
            if call["device"] in ungrouped or call["device"] in seen:
                continue
            seen.add(call["device"])
        kept.append(call)
    return kept


def _groups(call: dict[str, Any]) -> Any:
    """A convolution call's ``groups`` argument (by schema position or keyword)."""
    names = [a.name for a in op(call["op"])._schema.arguments]
    i = names.index("groups")
    return call["args"][i] if i < len(call["args"]) else call["kwargs"].get("groups", 1)


def _begin(target: Any, args: tuple, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    _pending.append(thread)
    return thread


def wait() -> None:
    """Join the threads ``start`` began (their calls done): nothing once they are. Inside a backward
    the thread of backward calls is not joined: it waits for autograd's device thread, which may be
    this one (its calls then run after this backward). cuBLAS keeps a workspace per handle and
    stream, which would outlive the thread's calls (12 MiB on an H100, counted in a training step's
    peak): they are dropped, and this thread's own is made again at its next matmul."""
    if not _pending:
        return
    in_backward = compat.in_backward()
    for thread in list(_pending):
        if in_backward and thread.name == BACKWARD_THREAD:
            continue
        thread.join()
        if thread in _pending:
            _pending.remove(thread)
    while _made:
        made = _made.pop()
        counters.bump("first_calls_made", made)
        if made and compat.clear_cublas_workspaces is not None and not torch.cuda.is_current_stream_capturing():
            compat.clear_cublas_workspaces()


def _run(calls: list[dict[str, Any]], driver: Callable[[], Any] | None) -> None:
    if driver is not None:
        try:
            driver()
        except Exception as exc:  # noqa: BLE001 - the first launch starts it and reports
            log.debug("cgtrees runtime: Triton's driver did not start beforehand (%s: %s)", type(exc).__name__, exc)
    _made.append(_make_all(calls))


def _make_all(calls: list[dict[str, Any]]) -> int:
    """Make ``calls`` in this thread, each failure logged and left to the real call; how many were made."""
    made, devices = 0, set()
    _bind_contexts({spec["device"] for spec in calls})
    with torch.no_grad():
        for spec in calls:
            try:
                device = torch.device(spec["device"])
                with torch.cuda.device(device):
                    _make(spec)
                devices.add(device)
                made += 1
            except Exception as exc:  # noqa: BLE001 - the real call meets it and reports
                log.debug("cgtrees runtime: a library call made beforehand failed (%s: %s): %s",
                          type(exc).__name__, exc, spec["op"])
        for device in devices:  # joined means done, on the device too
            torch.cuda.current_stream(device).synchronize()
    if made and compat.clear_cublas_workspaces is not None and not torch.cuda.is_current_stream_capturing():
        # this thread's cuBLAS workspaces (torch keeps them per thread in some versions): autograd's
        # device thread lives on, and its real backward may run on another stream than these calls
        compat.clear_cublas_workspaces()
    return made


def _bind_contexts(devices: set[str]) -> None:
    """Make each device's primary context current in this new thread before its first library call:
    ``torch.cuda.device`` sets no device that already looks current (device 0 in a new thread), its
    empty tensors may come from the allocator's cache without a CUDA call, and cuBLAS would then warn
    "Attempting to run cuBLAS, but there was no current CUDA context!" (a warm Llama start on an
    H200). A query that needs the context binds it."""
    for device in devices:
        try:
            torch.cuda.mem_get_info(torch.device(device))
        except Exception as exc:  # noqa: BLE001 - cuBLAS binds it itself, with its warning
            log.debug("cgtrees runtime: no CUDA context for %s beforehand (%s)", device, exc)


class _InBackward(torch.autograd.Function):
    """Identity whose backward makes the library calls it was given: autograd runs it on its
    device thread, where a real backward's calls run (cuDNN's plans and cuBLAS's handles are per
    thread)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, calls: list[dict[str, Any]]) -> torch.Tensor:
        ctx.calls = calls
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        _made.append(_make_all(ctx.calls))
        return grad, None


def _run_in_backward(calls: list[dict[str, Any]], after: threading.Thread | None = None) -> None:
    if after is not None:
        after.join()
    by_device: dict[str, list[dict[str, Any]]] = {}
    for call in calls:
        by_device.setdefault(call["device"], []).append(call)
    for device, some in by_device.items():
        try:
            with torch.enable_grad():
                seed = torch.zeros(1, device=device, requires_grad=True)
                _InBackward.apply(seed, some).backward(torch.ones(1, device=device))
        except Exception as exc:  # noqa: BLE001 - only time is lost
            log.debug("cgtrees runtime: backward calls made beforehand failed (%s: %s)", type(exc).__name__, exc)
