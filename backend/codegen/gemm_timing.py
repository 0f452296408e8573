"""Timing one GEMM candidate on the device, at compile time (``gemm_choice`` decides with it).

A candidate is a function of no arguments that launches its work on the current stream, its
tensors allocated beforehand (by the ``build`` that makes it, called only where the figure is not
known yet). It runs once (cuBLAS loads its kernel), once more under CUDA events
to size a batch of ``reps`` calls that fills about ``_TARGET_US``, and then the batch is captured in
one CUDA graph and replayed: the figure is GPU time, free of the host's launch cost, which on a
small GEMM is larger than the kernel (a 2.6 us gemv launched from Python costs 10 us a call). The
best replay, divided by ``reps``.

Another thread of the process may hold the GIL between a start event and the launch after it
(Triton's key hashed in the background, a parallel compile), and that wait must not count as GPU
time. So the sizing call is queued behind a spin of the GPU (about 1 ms), each timed replay behind an
untimed one, and while a form is timed another thread gives the GIL back within 0.1 ms
(``_gil_back_soon``). Without these a thread of pure Python made a 1 us kernel time at 10 ms
(Python's switch interval is 5 ms); with the switch interval alone, a 33 us one at 149 (the batch,
sized from the sizing call's host delay, was too short to cover the next launch; H200, 217c5b1).
Replays go on until ``_STABLE`` in a row bring no new best by more than 1%, at most ``_MAX_REPLAYS``.

Back to back, a call launched early (``pdl``) overlaps the tail of the call before it, and a form of
two kernels hides its second behind the next call's first. In a step the kernel before a form is
another one, which it cannot overlap that way. ``alone`` times each call after a plain kernel that
has ended (a one-element fill, not launched early), less that fill's own time, closer to how forms
of different launch counts run in a step (``grouped_attention``: a split attention and its combine
against one whole-cache kernel; in a Llama step the two took the same time, 0.86 ms a token).

Figures are kept for the process, keyed by the candidate's description (op, sizes, strides, dtype,
device): a shape met again (the backward's GEMMs repeat the forward's; layers repeat) is not
timed again. Timing needs a CUDA device that is not capturing a graph; ``unavailable`` says why not.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Callable, Iterator

import torch

from cgtrees.capture import recording_lock
from cgtrees.codegen import compat, pdl

_TARGET_US = 2000.0  # a batch's GPU time: long enough that a replay's launch is noise
_MAX_REPS = 100
_STABLE = 3
_MAX_REPLAYS = 10
_COVER_CYCLES = 2_000_000  # about 1 ms of the GPU's spin at 2 GHz, queued before the sizing call
_FIGURES: dict[str, float] = {}
_switch_lock = threading.Lock()
_switch_before = 0.005  # Python's switch interval before the first thread began timing
_timing_threads = 0


def unavailable(device: torch.device) -> str | None:
    """None where candidates can be timed on ``device``, else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no GPU to time on ({device})"
    if torch.cuda.is_current_stream_capturing():
        return "compiled while a CUDA graph is being captured"
    return None


def time_us(key: str, device: torch.device, build: Callable[[], Callable[[], None]], alone: bool = False) -> float:
    """Microseconds of GPU time per call of the candidate ``build()`` makes (its tensors allocated
    there, once), memoised under ``key``; ``alone``: each call after a plain kernel that has ended."""
    if alone:
        return max(0.0, time_us(f"{key} alone", device, lambda: _after_fill(device, build())) - _fill_us(device))
    if key in _FIGURES:
        return _FIGURES[key]
    candidate = build()
    with torch.cuda.device(device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), pdl.timing():
            candidate()  # loads the kernel; cuBLAS may also allocate its workspace here
            with _gil_back_soon():
                reps = _reps(_once_us(candidate))
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls (a warm load's first calls) are not the capture's
                with recording_lock, torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                    for _ in range(reps):
                        candidate()
                graph.replay()
                best = _best_replay_us(graph) / reps
        torch.cuda.current_stream().wait_stream(stream)
        del graph
    _FIGURES[key] = best
    return best


@contextlib.contextmanager
def _gil_back_soon() -> Iterator[None]:
    """Another thread holding the GIL gives it back to this one within 0.1 ms, not Python's 5: a late
    launch sizes a batch from a call's host time and delays a replay past the one queued before it.
    Threads timing at once share it: the first one in sets it, the last one out restores it."""
    global _switch_before, _timing_threads
    with _switch_lock:
        if _timing_threads == 0:
            _switch_before = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_before, 1e-4))
        _timing_threads += 1
    try:
        yield
    finally:
        with _switch_lock:
            _timing_threads -= 1
            if _timing_threads == 0:
                sys.setswitchinterval(_switch_before)


def _fill_us(device: torch.device) -> float:
    """A one-element fill's own time, back to back (each one waits for the one before)."""
    return time_us(f"fill {device}", device, lambda: _after_fill(device, lambda: None))


def _after_fill(device: torch.device, candidate: Callable[[], None]) -> Callable[[], None]:
    fence = torch.empty(1, device=device)

    def call() -> None:
        fence.fill_(0.0)  # a plain launch: it starts once the call before has ended, and ends first
        candidate()
    return call


def _once_us(candidate: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    compat.gpu_spin(_COVER_CYCLES)  # a late launch after the start event waits behind the spin, untimed
    start.record()
    candidate()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def _reps(once_us: float) -> int:
    return max(1, min(_MAX_REPS, int(_TARGET_US / max(once_us, 1.0))))


def _best_replay_us(graph: torch.cuda.CUDAGraph) -> float:
    best, since = float("inf"), 0
    for _ in range(_MAX_REPLAYS):
        us = _replay_us(graph)
        since = 0 if us < best * 0.99 else since + 1  # a new best by more than 1%
        best = min(best, us)
        if since == _STABLE:
            break
    return best


def _replay_us(graph: torch.cuda.CUDAGraph) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # the GPU is busy while the timed replay is queued: a late launch is not timed
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0


def forget() -> None:
    """Drop the figures (tests time the same shapes afresh)."""
    _FIGURES.clear()
