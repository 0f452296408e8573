"""Packaging: Dynamo finds the backend through the entry point; importing it registers nothing."""

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_listed_before_import_and_resolved_by_name():
    out = _run("""
        import sys, torch
        assert "backend" not in sys.modules
        print("listed" if "cgtrees" in torch._dynamo.list_backends() else "missing")
        f = torch.compile(lambda x: (x * 2).sin(), backend="cgtrees")
        x = torch.randn(5)
        torch.testing.assert_close(f(x), (x * 2).sin())
        from torch._dynamo.utils import counters
        print("compiled", counters["cgtrees"]["graphs_compiled"])
    """)
    assert "listed" in out and "compiled 1" in out


def test_import_does_not_register():
    out = _run("""
        import backend
        from torch._dynamo.backends import registry
        print(sorted(registry._COMPILER_FNS))
        import torch
        torch.compile(lambda x: x + 1, backend="cgtrees")(torch.ones(2))
        print("ok")
    """)
    assert "'cgtrees'" not in out.splitlines()[0] and "ok" in out
