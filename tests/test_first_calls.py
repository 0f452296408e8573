"""The library calls a kernel module makes, listed when it is generated (``codegen.library_calls``,
kept in its ``CompiledGraph``), for a warm load to make beforehand (``cgtrees.runtime.first_calls``): each with the
sizes, strides and dtype its ``call`` passes, so the call made on empty tensors is the same
configuration; only calls that are safe on uninitialised memory and draw no random numbers. The
thread itself runs on CUDA (tests/gpu/test_first_calls_gpu.py)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import INTERPRET, compile_fn, config, trace

from cgtrees.aot.rebuild import load_module
from cgtrees.aot.recorder import part_module
from cgtrees.codegen import library_calls
from cgtrees.compiled import CompiledGraph
from cgtrees.compiled_function import CompiledPart
from cgtrees.context import GraphContext
from cgtrees.runtime import first_calls

pytestmark = pytest.mark.skipif(not INTERPRET, reason="CUDA machine: codegen runs compiled in tests/gpu")


def _specs(module) -> list[dict]:
    return [json.loads(c) for c in module.graph.library_calls]


def _conv_mm(x, w, a, b):
    return F.conv2d(x, w, padding=1).relu(), (a @ b).sin()


def _conv_mm_inputs():
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    return x, torch.randn(4, 3, 3, 3), torch.randn(5, 6), torch.randn(6, 7).t().contiguous().t()


def test_a_module_lists_its_library_calls_with_the_layouts_it_passes():
    inputs = _conv_mm_inputs()
    module = compile_fn(_conv_mm, *inputs)
    specs = _specs(module)
    assert [s["op"] for s in specs] == ["aten.convolution.default", "aten.mm.default"], specs
    conv, mm = specs
    assert conv["args"][0]["tensor"] == [[2, 3, 8, 8], list(inputs[0].stride()), 0, "float32"]
    assert conv["args"][3:] == [[1, 1], [1, 1], [1, 1], False, [0, 0], 1]  # stride, padding, ... groups
    assert mm["args"][1]["tensor"] == [[6, 7], [1, 6], 0, "float32"]  # the column-major input as it is
    assert CompiledGraph.from_record(json.loads(json.dumps(module.graph.as_record()))) == module.graph  # kept
    # made on empty tensors, each call gives a result of the real one's size and strides
    expected = [F.conv2d(inputs[0], inputs[1], padding=1), inputs[2] @ inputs[3]]
    for text, want in zip(module.graph.library_calls, expected, strict=True):
        got = first_calls.call(text)
        assert got.shape == want.shape and got.stride() == want.stride(), (got.stride(), want.stride())


def test_level_1_records_keep_the_library_calls():
    inputs = _conv_mm_inputs()
    gm = trace(_conv_mm, *inputs)
    ctx = GraphContext(config=config(), kind="inference", name="g0_inference")
    module = compile_fn(_conv_mm, *inputs)
    part = CompiledPart("inference", ctx.name, part_module(gm, module, ctx.config), ())
    part = CompiledPart.from_record(json.loads(json.dumps(part.as_record())))  # as an entry stores it
    assert part.module.library_calls == module.graph.library_calls
    assert load_module(part, ctx).graph.library_calls == module.graph.library_calls
    assert len(module.graph.library_calls) == 2


def test_a_module_without_library_calls_lists_none():
    module = compile_fn(lambda t: t.sin() * 2, torch.randn(8))
    assert module.graph.library_calls == () and "aten." not in module.source.split("\ndef call(")[1]


def _spec(op: str, *args, **kwargs) -> dict:
    return {"op": op, "device": "cuda:0", "args": list(args), "kwargs": kwargs}


def _t(*size, dtype="float32"):
    stride, acc = [], 1
    for n in reversed(size):
        stride.insert(0, acc)
        acc *= n
    return {"tensor": [list(size), stride, 0, dtype]}


def test_only_calls_safe_on_empty_memory_and_without_randomness_are_kept():
    q = _t(1, 2, 16, 8, dtype="float16")
    flash = "aten._scaled_dot_product_flash_attention.default"
    assert library_calls._safe(_spec(flash, q, q, q, 0.0, True))
    assert not library_calls._safe(_spec(flash, q, q, q, 0.1, True))  # dropout draws random numbers
    assert not library_calls._safe(_spec(flash, q, q, q, dropout_p=0.5))
    assert library_calls._safe(_spec("aten.mm.default", _t(4, 4), _t(4, 4)))
    assert not library_calls._safe(_spec("aten.mm.default", _t(4, 4, dtype="int64"), _t(4, 4, dtype="int64")))
    big = _t(library_calls.MAX_BYTES // 4, 2)
    assert not library_calls._safe(_spec("aten.mm.default", big, _t(2, 2)))
    assert not library_calls._safe(_spec("aten.mm.default", 1, 2))  # no tensor at all


def test_random_ops_and_symbolic_sizes_are_never_listed():
    x = torch.randn(16, 32)
    w = torch.randn(32, 32)
    module = compile_fn(lambda t, m: (F.dropout(t @ m, 0.5, training=True), torch.rand_like(t)), x, w)
    assert [s["op"] for s in _specs(module)] == ["aten.mm.default"], module.graph.library_calls
    dynamic = compile_fn(lambda t, m: t @ m, x, w, dynamic=True)
    assert dynamic.graph.library_calls == ()  # sizes known only at the call


def test_start_without_cuda_calls_makes_no_thread():
    first_calls.start([json.dumps(_spec("aten.mm.default", _t(2, 2), _t(2, 2)) | {"device": "cpu"})])
    assert first_calls._pending == []
    first_calls.wait()  # nothing to join



def test_the_thread_makes_each_call_and_only_logs_a_failure(monkeypatch, caplog):
    """The thread's body (``_run``), CUDA's device context and stream stood in for on the CPU: a
    good call is made and counted, one that fails is logged at debug level and not counted."""
    import contextlib
    import logging
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(first_calls, "_made", [])
    good = _spec("aten.mm.default", _t(3, 4), _t(4, 5)) | {"device": "cpu"}
    bad = _spec("aten.mm.default", _t(3, 4), _t(5, 5)) | {"device": "cpu"}  # sizes that do not multiply
    with caplog.at_level(logging.DEBUG, logger="cgtrees.runtime"):
        first_calls._run([good, bad], None)
    assert first_calls._made == [1]
    assert "a library call made beforehand failed" in caplog.text and "aten.mm.default" in caplog.text


def _cpu_cuda(monkeypatch):
    """CUDA's device context and stream stood in for, so the threads' bodies run on the CPU."""
    import contextlib
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(synchronize=lambda: None))
    monkeypatch.setattr(first_calls, "_made", [])


def _conv(n: int, groups: int, device: str) -> dict:
    return _spec("aten.convolution.default", _t(n, 4, 8, 8), _t(4, 4 // groups, 3, 3), None, [1, 1], [1, 1],
                 [1, 1], False, [0, 0], groups) | {"device": device}


def test_forward_calls_leave_grouped_convolutions_to_the_real_call():
    """cuDNN's plans are per thread, costly for grouped convolutions: the forward thread makes every
    matmul and ungrouped convolution, and a grouped one only on a device with no other (the
    library's load)."""
    mm = _spec("aten.mm.default", _t(3, 4), _t(4, 5)) | {"device": "cuda:0"}
    calls = [_conv(1, 4, "cuda:0"), mm, _conv(1, 1, "cuda:0"), _conv(2, 1, "cuda:0"),
             _conv(1, 4, "cuda:1"), _conv(2, 4, "cuda:1"), _conv(3, 2, "cuda:1")]
    assert first_calls._ungrouped_convolutions(calls) == [mm, calls[2], calls[3], calls[4]]
    assert first_calls._groups(_spec("aten.convolution.default", groups=3)) == 3


def test_backward_calls_run_inside_a_backward(monkeypatch):
    """``_run_in_backward`` makes its calls in the backward of a small autograd graph, so that on
    CUDA they run on autograd's device thread, where the real backward's calls run."""
    _cpu_cuda(monkeypatch)
    seen = []
    monkeypatch.setattr(first_calls, "_make", lambda spec: seen.append(first_calls.compat.in_backward()))
    import threading

    calls = [_spec("aten.mm.default", _t(3, 4), _t(4, 5)) | {"device": "cpu"}] * 2
    forward = threading.Thread(target=lambda: seen.append("forward"))
    forward.start()
    first_calls._run_in_backward(calls, after=forward)  # after the forward thread: tensors never add up
    assert seen == ["forward", True, True] and first_calls._made == [2]


def test_wait_inside_a_backward_does_not_join_the_backward_thread(monkeypatch):
    """The thread of backward calls waits for autograd's device thread; a backward on that thread
    that joined it would wait for itself. ``wait`` there joins the other threads only."""
    import threading

    monkeypatch.setattr(first_calls, "_made", [])
    release = threading.Event()
    blocked = threading.Thread(target=release.wait, name=first_calls.BACKWARD_THREAD, daemon=True)
    plain = threading.Thread(target=lambda: None, name="cgtrees-first-calls", daemon=True)
    blocked.start()
    plain.start()
    monkeypatch.setattr(first_calls, "_pending", [blocked, plain])

    class Waits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            first_calls.wait()  # returns: the blocked thread is left
            return grad

    Waits.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert first_calls._pending == [blocked]
    release.set()
    first_calls.wait()  # outside a backward: joined
    assert first_calls._pending == []
