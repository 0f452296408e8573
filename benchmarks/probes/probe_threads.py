"""Two threads on one GPU: one runs a compiled model (recording CUDA graphs at new shapes), the other
draws inputs with ``torch.randn`` from the device's default generator. Does the second thread's draw
fail while the first records ("Offset increment outside graph capture encountered unexpectedly")?

    python benchmarks/probes/probe_threads.py [BACKEND ...]   (default: cgtrees reduce-overhead)

For each backend, three ways of drawing in the second thread: the default generator, a generator of
its own (``torch.Generator(device="cuda")``), and the default generator under
``cgtrees.runtime.recording_lock`` (cgtrees only). Prints the errors each way met.
"""

from __future__ import annotations

import sys
import threading

import torch


def compiled(backend: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    if backend == "reduce-overhead":
        return torch.compile(model, mode="reduce-overhead", dynamic=False)
    return torch.compile(model, backend=backend, dynamic=False)


def trial(backend: str, draw: str, rounds: int = 12) -> list[str]:
    torch._dynamo.reset()
    model = compiled(backend)
    errors: list[str] = []
    stop = threading.Event()

    def drawer() -> None:
        gen = torch.Generator(device="cuda") if draw == "own" else None
        while not stop.is_set():
            try:
                if draw == "lock":
                    import cgtrees.runtime as rt
                    with rt.recording_lock:
                        torch.randn(64, 64, device="cuda")
                else:
                    torch.randn(64, 64, device="cuda", generator=gen)
            except Exception as e:  # noqa: BLE001 - the probe counts what it meets
                errors.append(f"drawer: {type(e).__name__}: {str(e).splitlines()[0]}")
                if len(errors) > 5:
                    return

    t = threading.Thread(target=drawer)
    t.start()
    try:
        with torch.no_grad():
            for i in range(rounds):  # a new batch size each round: a compile or a recording
                for _ in range(3):
                    model(torch.ones(1 + i % 6, 256, device="cuda"))
    except Exception as e:  # noqa: BLE001
        errors.append(f"compiled: {type(e).__name__}: {str(e).splitlines()[0]}")
    stop.set()
    t.join()
    torch.cuda.synchronize()
    return errors


def main() -> None:
    backends = sys.argv[1:] or ["cgtrees", "reduce-overhead"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for backend in backends:
        for draw in ("default", "own") + (("lock",) if backend == "cgtrees" else ()):
            errors = trial(backend, draw)
            print(f"{backend:16s} draw={draw:8s} errors={len(errors)} {errors[:2]}", flush=True)


if __name__ == "__main__":
    main()
