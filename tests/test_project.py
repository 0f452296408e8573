"""The project's own promises: CI runs the README's test command; the README stays inside the
repository, says where cgtrees stands, lists every option and tells a GPU user how to install; the
demo installs without the test extras, works and says what a CPU run is; the benchmark pages open
with their tables and stay inside the repository."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_exactly_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    setup = next(b.strip() for b in blocks if "pytest" in b)  # install ... && python -m pytest ...
    *install, test_command = [part.strip() for part in setup.split("&&")]
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert f"\n{test_command}\n" in ci
    pins = [word for part in install for word in part.split() if "==" in word]
    assert "torch==2.13.0" in pins and all(pin in ci for pin in pins), (pins, ci)


REPO_PATH = re.compile(r"(?<![\w./-])((?:backend|docs|benchmarks|tests|\.ci)/[\w./-]*)")


def test_readme_points_only_inside_the_repository():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "../" not in readme and "/work/" not in readme and "shared/" not in readme
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not t.startswith(("http://", "https://", "#"))]
    named = {p.rstrip(".,:") for p in REPO_PATH.findall(readme)} | {t.split("#")[0] for t in links}
    assert "backend/api.py" in named and "docs/benchmarks.md" in named  # the pattern finds paths
    missing = sorted(p for p in named if not os.path.exists(os.path.join(ROOT, p)))
    assert not missing, f"README.md names files that are not in the repository: {missing}"


def test_readme_gives_a_gpu_user_an_install_line_without_the_cpu_pin():
    readme = open(os.path.join(ROOT, "README.md")).read()
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, re.S)]
    gpu = [b for b in blocks if "pip install" in b and "torch==" not in b]
    assert gpu and "python -m cgtrees" in gpu[0], blocks


def test_help_says_that_no_argument_runs_the_demo():
    done = subprocess.run([sys.executable, "-m", "cgtrees", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "with no argument, runs the demo" in " ".join(done.stdout.split())  # argparse wraps lines


@pytest.mark.timing  # a whole compile under a 300 s limit: 20 s alone on the H100, past 300 s beside 14 workers
@pytest.mark.cpu_default  # as a new user runs it
def test_demo_runs_and_matches_eager(tmp_path):
    env = {**os.environ, "CGTREES_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("CGTREES_INTERPRET", None)  # as a new user runs it
    done = subprocess.run([sys.executable, "-m", "cgtrees"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo OK" in done.stdout and "steady state per call" in done.stdout
    if "demo on CPU" in done.stdout:  # a CPU run says what it is instead of an unexplained ratio
        assert "runs each graph as Dynamo captured it (eager's ops, at eager's speed)" in done.stdout
        assert "graphs_as_captured=2" in done.stdout, done.stdout  # the inference graph and the training one
        assert "x eager" not in done.stdout, done.stdout
        assert "runs without CUDA graphs" not in done.stderr, done.stderr  # no warning per graph


def test_pytest_hides_only_the_interpreters_expected_numpy_warnings(tmp_path):
    """setup.cfg's filters drop numpy's floating-point warnings raised inside Triton's interpreter
    (inf and nan in masked-off lanes, as a GPU computes them) and torch's deprecation of the
    ``script_method`` its own mkldnn module uses, and nothing else."""
    (tmp_path / "test_w.py").write_text(
        "import warnings\n"
        "def warn(text, module, category=RuntimeWarning):\n"
        "    warnings.warn_explicit(text, category, 'x.py', 1, module=module)\n"
        "def test_w():\n"
        "    warn('`torch.jit.script_method` is deprecated. Please', 'torch.jit._script', DeprecationWarning)\n"
        "    warn('divide by zero encountered in log', 'triton.runtime.interpreter')\n"
        "    warn('divide by zero encountered in log', 'cgtrees.codegen.interp')\n"
        "    warn('something else', 'triton.runtime.interpreter')\n")
    shutil.copy(os.path.join(ROOT, "setup.cfg"), tmp_path)  # the project's pytest config, beside the test
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_w.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout
    assert "1 passed, 2 warnings" in done.stdout, done.stdout
    assert "something else" in done.stdout and done.stdout.count("divide by zero encountered in log") == 1


def test_readme_first_screen_says_where_cgtrees_stands_and_the_demo_needs_no_test_extras():
    readme = open(os.path.join(ROOT, "README.md")).read()
    first_screen = "\n".join(readme.splitlines()[:35])
    assert "NVIDIA GPU" in first_screen and "docs/benchmarks.md" in first_screen
    assert "On a CPU it is not faster" in first_screen  # CPU runs are for correctness, said up front
    blocks = [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme, re.S)]
    demo = next(b for b in blocks if "python -m cgtrees" in b and "torch==" in b)
    assert "[test]" not in demo and "pytest" not in demo, demo


def test_readme_lists_every_option_with_its_default_and_variable():
    import dataclasses

    from cgtrees.config import Config

    readme = open(os.path.join(ROOT, "README.md")).read()
    for f in dataclasses.fields(Config):
        default = f'"{f.default}"' if isinstance(f.default, str) else repr(f.default)
        row = f"| `{f.name}` | `{default}` | `CGTREES_{f.name.upper()}` |"
        assert row in readme, f"README.md's option table lacks {row}"


PAGES = ("docs/benchmarks.md", "docs/warm_start.md")
OUTSIDE = re.compile(r"DESIGN\.md|\bissue \d+|(?<![\w.-])/(?:root|tmp|work|home)/")


def test_benchmark_pages_open_with_their_table_and_point_only_inside_the_repository():
    """Each page opens with its suite's table (every backend, with the GPU, torch and commit of its
    rows), stays under 500 lines (dated readings live beside the results), and names nothing outside
    the repository: no design notes, issue numbers or paths of the GPU machine."""
    for page in PAGES:
        text = open(os.path.join(ROOT, page)).read()
        lines = text.splitlines()
        assert len(lines) < 500, (page, len(lines))
        assert not OUTSIDE.findall(text), (page, OUTSIDE.findall(text))
        first = next(i for i, line in enumerate(lines) if line.startswith("| "))  # the first table
        assert first < 20 and lines[first].endswith("| GPU | torch | commit |"), (page, first)
        links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not t.startswith(("http://", "https://", "#"))]
        named = {p.rstrip(".,:") for p in REPO_PATH.findall(text)}
        missing = sorted({p for p in named if not os.path.exists(os.path.join(ROOT, p))} |
                         {t for t in links if not os.path.exists(os.path.join(ROOT, "docs", t.split("#")[0]))})
        assert not missing, f"{page} names files that are not in the repository: {missing}"


def test_sources_state_their_rules_instead_of_citing_a_document_outside_the_repository():
    """The runtime's rules R1-R8 are written in backend/runtime/__init__.py; no source cites DESIGN.md."""
    cited = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(ROOT, "backend")) for f in files
             if f.endswith(".py") and "DESIGN.md" in open(os.path.join(d, f)).read()]
    assert not cited, cited
    rules = open(os.path.join(ROOT, "backend", "runtime", "__init__.py")).read()
    assert all(f"- R{n} " in rules for n in range(1, 9))
