"""A picture of the CUDA graph trees (``python -m cgtrees tree``, ``cgtrees.runtime.picture.dot()``).

One cluster per tree manager (device, thread, generation, pool bytes); one box per recording: its
function, the input shapes it was recorded for, why it was recorded (a new shape, a live output in
the way, a static input that moved, ...), its replays and the pool bytes its outputs hold. An edge
runs from the node that ran before it in the same generation (its parent): the recordings made
after one node in different steps are its children side by side, so each generation's path is a
branch of the tree. Functions that run without CUDA graphs are dashed boxes with their reason.

The text is Graphviz DOT; ``write`` renders it with ``dot`` where Graphviz is installed and writes
the DOT text otherwise.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _shape(key: Any) -> str:
    if key is None:
        return "static shapes"
    return " ".join("x".join(map(str, k)) if isinstance(k, tuple) else str(k) for k in key)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 0 else "unknown"


def dot(managers: list[Any] | None = None, skipped: dict[str, str] | None = None) -> str:
    """The trees as DOT text (the current process's when no argument is given)."""
    from cgtrees import runtime

    managers = runtime._managers.all() if managers is None else managers
    skipped = dict(runtime._skipped) if skipped is None else skipped
    lines = ["digraph cgtrees {", '  rankdir=TB; node [shape=box, fontname="monospace", fontsize=10];']
    for i, manager in enumerate(managers):
        nodes = manager.alive_nodes()
        lines.append(f"  subgraph cluster_{i} {{")
        title = (f"tree cuda:{manager.device} thread={manager.thread} generation={manager.generation} "
                 f"pool={_mib(manager.pool_bytes())}")
        lines.append(f"    label={_quote(title)};")
        ids = {node.id for node in nodes}
        lines.append(f'    root_{i} [label="step begins", shape=ellipse];')
        for node in nodes:
            label = (f"{node.function_name} ({node.kind})\nshape {_shape(node.key)}\n"
                     f"recorded: {getattr(node, 'reason', 'a new shape')}\nreplays {node.replays}\n"
                     f"pool {_mib(sum(n for _, n in node.pool_storages))}\ngeneration {node.generation}"
                     + ("\ncopies its outputs out" if node.copy_out else ""))
            lines.append(f"    n{node.id} [label={_quote(label)}];")
        for node in nodes:
            parent = f"n{node.parent_id}" if node.parent_id in ids else f"root_{i}"
            lines.append(f"    {parent} -> n{node.id} [label={_quote(f'gen {node.generation}')}];")
        lines.append("  }")
    for j, (name, reason) in enumerate(sorted(skipped.items())):
        label = _quote(name + ": no CUDA graphs\n" + reason)
        lines.append(f"  skipped_{j} [style=dashed, label={label}];")
    if not managers and not skipped:
        lines.append('  empty [label="no compiled function has run in this process"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(path: str | Path, text: str | None = None) -> Path:
    """The picture at ``path``: rendered by Graphviz's ``dot`` for a .svg/.png/.pdf path where it is
    installed; else the DOT text, at ``path`` with the suffix .dot (returned)."""
    text = dot() if text is None else text
    path = Path(path)
    fmt = path.suffix.lstrip(".").lower()
    renderer = shutil.which("dot")
    if fmt in ("svg", "png", "pdf") and renderer is not None:
        subprocess.run([renderer, f"-T{fmt}", "-o", str(path)], input=text, text=True, check=True, timeout=60)
        return path
    if fmt != "dot":
        path = path.with_suffix(".dot")
    path.write_text(text)
    return path
