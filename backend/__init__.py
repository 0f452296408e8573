"""cgtrees: a torch.compile backend (``torch.compile(model, backend="cgtrees")``).

Dynamo finds it through the ``torch_dynamo_backends`` entry point, which names ``cgtrees:cgtrees``;
importing this package registers nothing itself (a second registration would fail). It does put
``cgtrees.marks.mark_step_begin`` in the place of ``torch.compiler.cudagraph_mark_step_begin``: the
same mark, without importing Inductor's compiler at the first one (2 s of a warm start).
"""

from __future__ import annotations

from cgtrees import marks
from cgtrees.api import CgtreesBackend

marks.install()

__version__ = "0.1.0"

cgtrees = CgtreesBackend()


def reset() -> None:
    """Free every compiled graph's CUDA graph trees and forget logged reasons."""
    cgtrees.reset()


__all__ = ["cgtrees", "reset", "CgtreesBackend", "__version__"]
