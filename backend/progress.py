"""One progress line on the terminal for compiles longer than a few seconds.

A cold compile of a real model takes tens of seconds (GPT-2 training 43 s, a 1.1B decode step 25 s);
without a word the user cannot tell a long compile from a hang. While a Dynamo graph compiles for
more than ``DELAY_S``, one line on stderr, rewritten in place every ``EVERY_S``, says which graph of
the process it is, how many kernels were generated and GEMM candidates timed so far, and the time
spent; the line is cleared when the compile ends. Nothing is written when stderr is not a terminal
(logs, CI, pipes), or with the option ``progress=False`` / ``CGTREES_PROGRESS=0``.

A daemon thread draws the line; the compile itself only marks its start and end (``compiling``).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import IO, Iterator

from cgtrees import counters

DELAY_S = 3.0
EVERY_S = 0.5


class Progress:
    def __init__(self, stream: IO[str] | None = None, delay_s: float = DELAY_S, every_s: float = EVERY_S) -> None:
        self.stream, self.delay_s, self.every_s = stream, delay_s, every_s
        self._lock = threading.Lock()
        self._started: float | None = None  # the running compile's start (None: none runs)
        self._graph = ""
        self._count = 0  # Dynamo graphs this process began compiling
        self._shown = 0  # width of the line on the screen (0: none)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def _out(self) -> IO[str]:
        return self.stream if self.stream is not None else sys.stderr

    @contextlib.contextmanager
    def compiling(self, graph: str, enabled: bool = True) -> Iterator[None]:
        """Around one Dynamo graph's compile (nested compiles, a lazy backward's, count as theirs)."""
        out = self._out()
        if not enabled or not getattr(out, "isatty", lambda: False)() or self._started is not None:
            yield
            return
        with self._lock:
            self._started, self._graph = time.perf_counter(), graph
            self._count += 1
            self._start_thread()
        try:
            yield
        finally:
            with self._lock:
                self._started = None
                self._clear()

    def line(self, now: float | None = None) -> str:
        """The progress line for the running compile."""
        figures = sys.modules.get("cgtrees.codegen.gemm_timing")
        timed = len(getattr(figures, "_FIGURES", {})) if figures is not None else 0
        elapsed = (now if now is not None else time.perf_counter()) - (self._started or 0.0)
        return (f"cgtrees: compiling {self._graph} (graph {self._count} of this process): "
                f"{counters.get('kernels_generated')} kernels generated, {timed} GEMM candidates timed, "
                f"{elapsed:.0f} s")

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="cgtrees-progress", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self._wake.wait(self.every_s)
            with self._lock:
                started = self._started
                if started is not None and time.perf_counter() - started >= self.delay_s:
                    self._draw(self.line())

    def _draw(self, text: str) -> None:
        out = self._out()
        out.write("\r" + text.ljust(self._shown))
        out.flush()
        self._shown = len(text)

    def _clear(self) -> None:
        if self._shown:
            out = self._out()
            out.write("\r" + " " * self._shown + "\r")
            out.flush()
            self._shown = 0


PROGRESS = Progress()
