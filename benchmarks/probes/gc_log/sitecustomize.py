"""Where Python's cyclic collector pauses a benchmark worker: put this directory on PYTHONPATH and set
DIAG_GC_DIR, and every process started (run.py's workers too) writes DIAG_GC_DIR/gc-PID.txt: its command
line, then one line per collection longer than 3 ms (time, generation, milliseconds, objects collected,
the innermost frames and the worker's own frames)::

    DIAG_GC_DIR=/tmp/gc PYTHONPATH=benchmarks/probes/gc_log python benchmarks/run.py --suite real --models gpt2 ...

It found the full collection (0.20-0.25 s, the whole process walked) inside GPT-2's warm ``torch.compile``
call (``benchmarks/results/real-h200-pc/gc-full-collections-gpt2-warm.txt``). Without DIAG_GC_DIR it does nothing.
"""

import gc
import os
import sys
import time

_DIR = os.environ.get("DIAG_GC_DIR")
_WORKER_FILES = ("worker.py", "eval_frame.py", "package.py", "precompile.py")


def _frames() -> list[str]:
    frames, frame = [], sys._getframe(0)
    while frame is not None and len(frames) < 400:
        code = frame.f_code
        frames.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno}:{code.co_name}")
        frame = frame.f_back
    return frames[2:6] + [f for f in frames if f.startswith(_WORKER_FILES)][:6]


def _install(directory: str) -> None:
    log = open(os.path.join(directory, f"gc-{os.getpid()}.txt"), "w", buffering=1)  # noqa: SIM115 - the process's life
    log.write(" ".join(sys.argv) + "\n")
    started = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > 0.003:
            log.write(f"{time.time():.3f} gen{info['generation']} {took * 1000:.1f}ms collected {info['collected']} "
                      f"at {' < '.join(_frames())}\n")

    gc.callbacks.append(callback)


if _DIR:
    _install(_DIR)
