"""One CUDA graph memory pool on one device: what a recorded graph needs of its tree manager.

Invariants: every graph recorded into the pool is captured on ``stream``; ``live`` lists the pool
storages handed out that the user may still hold (``liveness``), and is replaced, never mutated
from outside, when the manager sweeps it, so a node reads it through the pool each time;
``generation`` counts the steps of the user's program (R3). The tree manager (``manager``) is a
pool with a tree of nodes and the rules that pick, record and retire them.
"""

from __future__ import annotations

import torch

from cgtrees.runtime.liveness import LiveOutput


class Pool:
    def __init__(self, device: int) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)
        self.live: list[LiveOutput] = []
        self.generation = 0
