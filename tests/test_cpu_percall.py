"""CPU per call (issue 54, item 4): where no kernel is generated cgtrees runs the aten ops eager runs
(one intra-op thread, backends interleaved: ``benchmarks/cpu_percall.py``, rows in
``benchmarks/results/cpu/``). The target is 1.1x eager; what is left over eager on the demo's block
(1.09-1.12x) is Dynamo's and AOTAutograd's per-call cost, which ``aot_eager`` (no compiler at all)
pays too: cgtrees must be no slower than that floor (decomposed for codegen, it was 1.76x and 1.88x
eager, 1.5x and 1.7x the floor)."""

from __future__ import annotations

import pytest
from bench_helpers import bench


@pytest.mark.timing
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_demo_per_call_is_at_the_floor_of_dynamo_and_aot_autograd(mode):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        row = bench("cpu_percall").measure("demo", mode, windows=7, budget_s=4.0)
    finally:
        torch.set_num_threads(threads)
    print(row)
    assert row["cgtrees_us"] <= 1.05 * row["aot_eager_us"], row  # at the floor, within noise
    assert row["cgtrees_over_eager"] <= 1.15, row  # the target is 1.1x: see the docstring


def test_no_decomposition_where_no_kernel_is_generated():
    import torch

    from cgtrees.aot import decompositions

    cpu, cuda_like = [torch.empty(2)], [torch.empty(2, device="meta")]
    assert decompositions.for_inputs(cpu, interpret=False) == {}
    assert decompositions.for_inputs(cpu, interpret=True) is decompositions.decomposition_table()
    assert decompositions.generates_kernels(cuda_like, interpret=False) is False  # only CUDA tensors get kernels
