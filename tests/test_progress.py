"""The progress line (issue 54, item 11): on a terminal only, for compiles longer than the delay,
cleared at the end; off with ``progress=False`` / ``CGTREES_PROGRESS=0``."""

from __future__ import annotations

import io
import time

import torch

from cgtrees import progress
from cgtrees.config import Config


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_long_compile_shows_one_line_then_clears_it():
    out = Terminal()
    p = progress.Progress(out, delay_s=0.05, every_s=0.01)
    with p.compiling("g3"):
        time.sleep(0.3)
    text = out.getvalue()
    shown = [part for part in text.split("\r") if part.strip()]
    assert shown and all(s.startswith("cgtrees: compiling g3 (graph 1 of this process): ") for s in shown), shown
    assert "kernels generated, 0 GEMM candidates timed" in shown[-1] and shown[-1].rstrip().endswith(" s"), shown
    assert text.endswith("\r" + " " * len(shown[-1].rstrip()) + "\r") or text.endswith(" \r"), repr(text[-40:])
    assert "\n" not in text  # one line, rewritten in place


def test_nothing_for_a_short_compile_a_pipe_or_when_turned_off():
    for out, enabled, seconds in ((Terminal(), True, 0.0), (io.StringIO(), True, 0.2), (Terminal(), False, 0.2)):
        p = progress.Progress(out, delay_s=0.05, every_s=0.01)
        with p.compiling("g0", enabled):
            time.sleep(seconds)
        time.sleep(0.05)
        assert out.getvalue() == "", (enabled, seconds, out.getvalue())
    assert Config.resolve(environ={"CGTREES_PROGRESS": "0"}).progress is False


def test_torch_compile_draws_it_on_a_terminal(monkeypatch):
    out = Terminal()
    monkeypatch.setattr(progress.PROGRESS, "stream", out)
    monkeypatch.setattr(progress.PROGRESS, "delay_s", 0.0)
    monkeypatch.setattr(progress.PROGRESS, "every_s", 0.001)
    torch._dynamo.reset()
    f = torch.compile(lambda x: (x.sin() * 2).softmax(-1), backend="cgtrees", options={"cache": False})
    x = torch.randn(4, 9)
    torch.testing.assert_close(f(x), (x.sin() * 2).softmax(-1))
    assert "cgtrees: compiling g" in out.getvalue(), repr(out.getvalue())
