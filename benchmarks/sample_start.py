"""Where a worker's first calls spend their wall time: the main thread's stack, sampled.

    python benchmarks/sample_start.py --out start.txt -- --workload convnet --backend cgtrees \\
        --mode train --phase warm [other worker.py arguments]

Runs ``worker.py`` with those arguments (caches as the environment says: run it twice on the same
cache directories for a warm start; ``--backend cgtrees-pc`` also needs ``CGTREES_PRECOMPILE_CACHE=1``)
and, while the model is compiled (the ``torch.compile`` call: where Dynamo's caching precompile loads a
saved entry) and while its first outputs are timed, reads the main thread's stack every ``--interval``
seconds from a second thread; the two windows are reported apart. Each sample counts the time since
the last one for every function on the stack (inclusive), for the innermost one (exclusive) and for
the innermost few frames together (who called the costly function).
Unlike cProfile it adds little time (a few percent) and sees through Dynamo's frame evaluation; a
sample waits while the main thread holds the GIL in C, so long C calls land on their Python caller.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import measure
import worker

SITE = "site-packages/"
STACK_DEPTH = 6  # frames kept per sample for the stacks section: who called the costly function


def _where(frame) -> str:
    code = frame.f_code
    path = code.co_filename
    path = path[path.index(SITE) + len(SITE):] if SITE in path else path
    return f"{path}:{code.co_firstlineno}({code.co_name})"


def _stack(frame) -> tuple[str, ...]:
    out = []
    while frame is not None and len(out) < STACK_DEPTH:
        out.append(_where(frame))
        frame = frame.f_back
    return tuple(out)


class StackSampler:
    """Samples one thread's stack until stopped; ``report()`` is the text of the totals."""

    def __init__(self, thread_id: int, interval: float) -> None:
        self.thread_id, self.interval = thread_id, interval
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.exclusive: collections.Counter[str] = collections.Counter()
        self.stacks: collections.Counter[tuple[str, ...]] = collections.Counter()  # innermost STACK_DEPTH frames
        # Python work on other threads (the autograd engine's device thread runs a CUDA backward,
        # the first-calls thread its calls): innermost frames, by thread name
        self.others: collections.Counter[tuple[str, ...]] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._start = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval):
            now = time.perf_counter()
            weight, last = now - last, now
            frames = sys._current_frames()
            self._sample_others(frames, weight)
            frame = frames.get(self.thread_id)
            if frame is not None:
                self.exclusive[_where(frame)] += weight
                self.stacks[_stack(frame)] += weight
            seen = set()
            while frame is not None:
                where = _where(frame)
                if where not in seen:
                    seen.add(where)
                    self.inclusive[where] += weight
                frame = frame.f_back

    def _sample_others(self, frames: dict, weight: float) -> None:
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in frames.items():
            if ident not in (self.thread_id, self._thread.ident):
                self.others[(names.get(ident, "?"), *_stack(frame))] += weight

    def report(self, rows: int = 150) -> str:
        lines = [f"window {self.seconds:.3f} s, sampled every {self.interval * 1e3:.1f} ms", "",
                 "## inclusive (s)"]
        lines += [f"{s:8.3f} {where}" for where, s in self.inclusive.most_common(rows)]
        lines += ["", "## exclusive (s)"]
        lines += [f"{s:8.3f} {where}" for where, s in self.exclusive.most_common(rows // 3)]
        lines += ["", f"## innermost {STACK_DEPTH} frames, innermost first (s)"]
        for stack, s in self.stacks.most_common(rows // 5):
            lines += [f"{s:8.3f} {stack[0]}", *(f"           < {where}" for where in stack[1:])]
        lines += ["", f"## other threads' innermost {STACK_DEPTH} frames, by thread (s)"]
        for (thread, *stack), s in self.others.most_common(rows // 5):
            lines += [f"{s:8.3f} [{thread}] {stack[0]}", *(f"           < {where}" for where in stack[1:])]
        return "\n".join(lines) + "\n"


def _imported(before: set[str]) -> str:
    new = sorted(set(sys.modules) - before)
    return f"\n## modules imported in the window ({len(new)})\n" + " ".join(new) + "\n"


def sampling(first_outputs: Callable, out: Path, interval: float) -> Callable:
    def sampled(*args: object, **kwargs: object) -> list[float]:
        before = set(sys.modules)
        with StackSampler(threading.get_ident(), interval) as sampler:
            marks = first_outputs(*args, **kwargs)
        head = out.read_text() + "\n# the first outputs\n" if out.exists() else ""
        out.write_text(head + sampler.report() + _imported(before))
        return marks

    return sampled


def sampling_compile(compile_model: Callable, out: Path, interval: float) -> Callable:
    """The first call only (the eager reference after the timed calls builds its model too)."""
    def sampled(*args: object, **kwargs: object) -> object:
        if out.exists():
            return compile_model(*args, **kwargs)
        before = set(sys.modules)
        with StackSampler(threading.get_ident(), interval) as sampler:
            fn = compile_model(*args, **kwargs)
        out.write_text("# the torch.compile call\n" + sampler.report() + _imported(before))
        return fn

    return sampled


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the sampled totals, as text")
    parser.add_argument("--interval", type=float, default=0.0005, help="seconds between samples")
    args = parser.parse_args(argv[:split])
    args.out.unlink(missing_ok=True)
    worker.compile_model = sampling_compile(worker.compile_model, args.out, args.interval)
    measure.first_outputs = sampling(measure.first_outputs, args.out, args.interval)
    sys.argv = [str(Path(worker.__file__)), *argv[split + 1:]]
    worker.main()


if __name__ == "__main__":
    main()
