"""Threads and the default CUDA generator (issue 54, item 6).

With torch 2.11 a CUDA-graph capture flags the device's default generator as capturing for every
thread, so another thread's ``torch.randn`` during one of our recordings raises "Offset increment
outside graph capture encountered unexpectedly" (reduce-overhead's recordings do the same:
``benchmarks/probes/probe_threads.py``). The rule (README, "Threads"): draw in other threads with a
generator of their own, or hold ``cgtrees.runtime.recording_lock`` around the draw. These tests run
both workarounds while the compiled thread records at a new shape every few calls, and two
compiling threads side by side, and compare every output with eager's.
"""

import threading

import pytest
import torch

import cgtrees.runtime

SHAPES = (1, 3, 5, 2, 7, 4)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 96)).cuda()


def _run_compiled(model: torch.nn.Module, errors: list[str], rounds: int = 3) -> None:
    compiled = torch.compile(model, backend="cgtrees", dynamic=False)
    try:
        with torch.no_grad():
            for _ in range(rounds):  # warmup, record, replay at each shape
                for rows in SHAPES:
                    x = torch.arange(rows * 96, device="cuda", dtype=torch.float32).reshape(rows, 96) / 500
                    got, want = compiled(x), model(x)
                    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item()):
                        errors.append(f"rows {rows}: max error {(got - want).abs().max().item():.3e}")
    except Exception as exc:  # noqa: BLE001 - the test lists what any thread met
        errors.append(f"compiled thread: {type(exc).__name__}: {exc}")


def _draws(how: str, stop: threading.Event, errors: list[str], drawn: list[int]) -> None:
    gen = torch.Generator(device="cuda") if how == "own generator" else None
    while not stop.is_set():
        try:
            if how == "recording_lock":
                with cgtrees.runtime.recording_lock:
                    torch.randn(64, 64, device="cuda")
            else:
                torch.randn(64, 64, device="cuda", generator=gen)
            drawn[0] += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(f"drawing thread: {type(exc).__name__}: {exc}")
            return


@pytest.mark.parametrize("how", ["own generator", "recording_lock"])
def test_other_thread_draws_while_we_record(how, no_tf32):
    errors: list[str] = []
    drawn = [0]
    stop = threading.Event()
    drawer = threading.Thread(target=_draws, args=(how, stop, errors, drawn))
    drawer.start()
    try:
        _run_compiled(_model(), errors)
    finally:
        stop.set()
        drawer.join()
    torch.cuda.synchronize()
    counts = torch._dynamo.utils.counters["cgtrees"]
    assert counts["cudagraph_recorded"] >= len(SHAPES), dict(counts)  # it did record while the other drew
    assert drawn[0] > 0
    assert errors == []


def test_two_threads_record_side_by_side(no_tf32):
    """Each thread's first calls warm up and record in a tree of its own, at the same time. The
    compiles happen first, on this thread: Dynamo cannot compile in one thread while another runs
    compiled code (torch's FX-tracing flag is process-wide: "Detected that you are using FX to
    symbolically trace a dynamo-optimized function")."""
    errors: list[str] = []
    models = [_model(), _model()]
    compiled = [torch.compile(m, backend="cgtrees", dynamic=False) for m in models]
    with torch.no_grad():
        for f in compiled:
            for rows in SHAPES:
                f(torch.ones(rows, 96, device="cuda"))

    def run(model: torch.nn.Module, f) -> None:
        try:
            with torch.no_grad():
                for _ in range(3):
                    for rows in SHAPES:
                        x = torch.arange(rows * 96, device="cuda", dtype=torch.float32).reshape(rows, 96) / 500
                        torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-4)
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=run, args=pair) for pair in zip(models, compiled)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert errors == []
    assert torch._dynamo.utils.counters["cgtrees"]["cudagraph_recorded"] >= 2 * len(SHAPES)
