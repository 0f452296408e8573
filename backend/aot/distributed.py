"""What data-parallel training needs from us: DDPOptimizer's pieces.

Under ``DistributedDataParallel`` (both ``torch.compile(DDP(m))`` and ``DDP(torch.compile(m))``:
what matters is that DDP's forward is running, ``DistributedDataParallel._inside_ddp_forward``),
Dynamo's DDPOptimizer (``torch._dynamo.config.optimize_ddp``, on by default) splits each graph at
DDP's gradient-bucket boundaries and hands every piece to the backend as a graph of its own. Between
the pieces' backward graphs the autograd engine fires DDP's hooks, so all-reduces start while the
earlier layers' gradients are still being computed; the hooks run outside our graphs, in eager.
A model whose parameters fit in DDP's first bucket (1 MiB) is one piece: no split.

What torch (2.11, 2.13) does around us, on CPU and CUDA alike:
- ``torch.compile(DDP(m))``: Dynamo breaks the graph in DDP's forward (at
  ``Logger.set_runtime_stats_and_log``, and at ``_inside_ddp_forward``, which is disabled for
  Dynamo), so DDP's forward and reducer run eagerly; ``m``'s forward is then compiled as a frame
  of its own, inside ``_inside_ddp_forward``: DDPOptimizer. A forward that is torch's own
  (``nn.Sequential``) is no frame Dynamo starts at, so no backend gets a graph (``aot_eager``
  neither): the model needs a forward of the user's.
- FSDP2 (``fully_shard``): its hooks are not traced (``skip_fsdp_hooks``): the graph breaks at
  each sharded module's call (inside a loop, the frame runs eagerly), its all-gathers and
  reduce-scatters run eagerly between our graphs.

Invariants:
- DDPOptimizer decides whether a piece went through AOTAutograd by watching
  ``counters["aot_autograd"]["total"]`` (torch's ``aot_autograd`` backend wrapper bumps it; we call
  ``aot_module_simplified`` ourselves). Then it keeps each piece's forward metadata, which
  AOTAutograd's lazy backward compile reads back piece by piece. Not bumped: the first backward
  of a split graph fails ("expected same # of fw and bw compiles, but found bucket -1").
- A piece's first call is made by DDPOptimizer at compile time with fake tensors, and AOTAutograd
  answers it with fake outputs (``fakify_first_call``). So a piece keeps AOTAutograd's runtime
  wrappers: our lean inference wrapper would run the kernel module on fake tensors.
- Nothing else changes: the pieces are ordinary graphs of ours (one tree manager per device and
  thread, so one tree holds the pieces of a step on CUDA), and eager DDP reads the gradients that
  our backward graphs return as it reads eager's.
"""

from __future__ import annotations

import logging

from backend import counters
from backend.aot import compat

log = logging.getLogger("backend.aot")


def before_aot(name: str) -> bool:
    """Called just before we hand a Dynamo graph to AOTAutograd. Returns whether the graph is a
    DDPOptimizer piece (then it keeps AOTAutograd's runtime wrappers)."""
    compat.count_aot_autograd_compile()  # DDPOptimizer's sign that AOTAutograd ran
    piece = compat.ddp_optimizer_piece()
    if piece is None:
        return False
    counters.bump("ddp_pieces")
    log.info("cgtrees: %s is piece %d of a graph DDPOptimizer split at DDP's bucket boundaries", name, piece)
    return True
