"""The project's own promises: CI runs the README's test command; the demo works."""

import os
import re
import subprocess
import sys

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


def test_demo_runs_and_matches_eager(tmp_path):
    env = {**os.environ, "CGTREES_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "backend"], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "demo OK" in done.stdout and "steady state per call" in done.stdout
