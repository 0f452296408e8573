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
        import cgtrees
        from torch._dynamo.backends import registry
        print(sorted(registry._COMPILER_FNS))
        import torch
        torch.compile(lambda x: x + 1, backend="cgtrees")(torch.ones(2))
        print("ok")
    """)
    assert "'cgtrees'" not in out.splitlines()[0] and "ok" in out


def test_installed_as_cgtrees_with_no_top_level_backend(tmp_path):
    """`import cgtrees` and `python -m cgtrees` work from any directory; no module named `backend` is
    loaded (the repository's folder is installed under the name cgtrees)."""
    done = subprocess.run([sys.executable, "-c", "import sys, cgtrees, cgtrees.aot.driver, cgtrees.cache, "
                           "cgtrees.codegen, cgtrees.runtime; import importlib.util as u; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'backend'), "
                           "u.find_spec('backend') is None)"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "True"], done.stdout


def test_every_folder_of_the_package_is_installed():
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parent.parent
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {"cgtrees": "backend"}
    folders = {"cgtrees" + "".join(f".{p}" for p in d.relative_to(root / "backend").parts)
               for d in [root / "backend", *(root / "backend").rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))}
    assert folders == set(tool["packages"]), folders ^ set(tool["packages"])
