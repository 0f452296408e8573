"""Per call on the CPU with Dynamo alone beside the backends of ``cpu_percall.py``: eager, ``dynamo``
(``backend="eager"``: Dynamo's graph under eager's autograd, what ``cgtrees.aot.as_captured`` runs),
``aot_eager`` and cgtrees, one intra-op thread, windows interleaved, the median window.

    python benchmarks/probes/probe_cpu_floor.py demo,mlp_small,norm_act
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu_percall  # noqa: E402

BACKENDS = ("eager", "dynamo", "aot_eager", "cgtrees")


def main() -> None:
    torch.set_num_threads(1)
    for name in sys.argv[1].split(","):
        for mode in ("infer", "train"):
            row = cpu_percall.measure(name, mode, windows=7, budget_s=4.0, backends=BACKENDS)
            eager = row["eager_us"]
            print(name, mode, {b: f"{row[f'{b}_us']:.0f} ({row[f'{b}_us'] / eager:.2f}x)" for b in BACKENDS},
                  flush=True)


if __name__ == "__main__":
    main()
