"""The picture of the trees (issue 54, item 8): ``cgtrees.runtime.picture`` and ``python -m cgtrees tree``.
On CPU no graph is recorded, so the trees here are made of stand-ins with the attributes a node has;
tests/gpu/test_tree_picture_gpu.py draws a real training loop's."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from cgtrees.runtime import picture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _node(id_, parent, name, kind, key, reason, replays, pool, gen):
    return SimpleNamespace(id=id_, parent_id=parent, function_name=name, kind=kind, key=key, reason=reason,
                           replays=replays, pool_storages=[(0, pool)], generation=gen, copy_out=False)


def test_one_box_per_recording_with_shape_reason_replays_pool_and_generations_as_branches():
    nodes = [_node(1, None, "g0_forward", "forward", ((8, 32),), "a new shape", 5, 2**20, 1),
             _node(2, 1, "g0_backward", "backward", None, "a new shape", 5, 2**19, 1),
             _node(3, 1, "g0_backward", "backward", None, "a live output is in the way", 0, 2**19, 2)]
    manager = SimpleNamespace(device=0, thread="MainThread", generation=3, alive_nodes=lambda: nodes,
                              pool_bytes=lambda: 4 * 2**20)
    text = picture.dot([manager], {"g1_inference": "CPU inputs"})
    assert text.startswith("digraph cgtrees {") and text.rstrip().endswith("}")
    assert 'label="tree cuda:0 thread=MainThread generation=3 pool=4.0 MiB"' in text
    assert ('n1 [label="g0_forward (forward)\\nshape 8x32\\nrecorded: a new shape\\nreplays 5\\npool 1.0 MiB\\n'
            'generation 1"]') in text
    assert "recorded: a live output is in the way\\nreplays 0\\npool 0.5 MiB\\ngeneration 2" in text
    # the two backwards recorded after the same forward in two steps: siblings, one branch each
    assert 'n1 -> n2 [label="gen 1"]' in text and 'n1 -> n3 [label="gen 2"]' in text
    assert 'root_0 -> n1 [label="gen 1"]' in text
    assert 'skipped_0 [style=dashed, label="g1_inference: no CUDA graphs\\nCPU inputs"]' in text


def test_write_gives_dot_text_where_graphviz_is_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(picture.shutil, "which", lambda name: None)
    written = picture.write(tmp_path / "tree.svg", "digraph cgtrees {\n}\n")
    assert written == tmp_path / "tree.dot" and written.read_text() == "digraph cgtrees {\n}\n"
    assert not (tmp_path / "tree.svg").exists()


def test_python_m_cgtrees_tree_writes_the_picture(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no Graphviz: DOT text
    done = subprocess.run([sys.executable, "-m", "cgtrees", "tree", "--out", str(tmp_path / "tree.svg"),
                           "--steps", "2"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"wrote {tmp_path / 'tree.dot'}" in done.stdout and "dot -Tsvg" in done.stdout, done.stdout
    text = (tmp_path / "tree.dot").read_text()
    assert "g0_forward: no CUDA graphs\\nCPU inputs" in text and "g0_backward" in text, text


def test_readme_shows_a_real_models_tree():
    """Item 8's picture in the docs: drawn from GPT-2 small on the GPU, rendered, and shown in the README."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    assert "![" in (readme := (root / "README.md").read_text()) and "(docs/tree-gpt2.svg)" in readme
    dot_text, svg = (root / "docs/tree-gpt2.dot").read_text(), (root / "docs/tree-gpt2.svg").read_text()
    boxes = [line for line in dot_text.splitlines() if line.strip().startswith("n") and "[label=" in line]
    assert any("g0_backward (backward)" in b for b in boxes) and any("(inference)" in b for b in boxes)
    parents = [line.split("->")[0].strip() for line in dot_text.splitlines() if "->" in line]
    assert max(parents.count(p) for p in set(parents)) >= 2  # a branch: one node with two children
    assert "g0_forward (forward)" in svg
