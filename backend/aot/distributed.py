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
  answers it with fake outputs (``fakify_first_call``). So a piece compiled here keeps
  AOTAutograd's runtime wrappers: our lean inference wrapper would run the kernel module on fake
  tensors.
- A piece that level 1 holds (its example activations are fake tensors, keyed as any tensor) is
  loaded without AOTAutograd, and the counter is not bumped: DDPOptimizer then makes the fake
  outputs itself, running the piece's graph on its fake inputs, and keeps no metadata for it. The
  metadata it keeps for the pieces AOTAutograd compiles is a stack, read back one piece per lazy
  backward compile in reverse order; a loaded piece neither pushes nor pops (its backward is ours),
  so hits and misses mix in one graph (the ranks of one cache: one may write what the other loads).
- Nothing else changes: the pieces are ordinary graphs of ours (one tree manager per device and
  thread, so one tree holds the pieces of a step on CUDA), and eager DDP reads the gradients that
  our backward graphs return as it reads eager's.
"""

from __future__ import annotations

import logging

from cgtrees import counters
from cgtrees.aot import compat

log = logging.getLogger("cgtrees.aot")


def is_piece(name: str) -> bool:
    """Whether the Dynamo graph being compiled is a DDPOptimizer piece (counted in ``ddp_pieces``,
    whether level 1 holds it or AOTAutograd compiles it)."""
    piece = compat.ddp_optimizer_piece()
    if piece is None:
        return False
    counters.bump("ddp_pieces")
    log.info("cgtrees: %s is piece %d of a graph DDPOptimizer split at DDP's bucket boundaries", name, piece)
    return True


def before_aot() -> None:
    """Called just before we hand a Dynamo graph to AOTAutograd (not on a level-1 hit)."""
    compat.count_aot_autograd_compile()  # DDPOptimizer's sign that AOTAutograd ran
