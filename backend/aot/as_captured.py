"""A Dynamo graph that holds no CUDA tensor, where Triton is not interpreted, runs as Dynamo captured it.

Nothing of ours makes such a graph faster: no kernel is generated for CPU tensors, no CUDA graph
records, and a compile that does neither is not worth caching. What is left of the pipeline is its
per-call cost: AOTAutograd's wrappers and its autograd function cost 1.14-1.31x eager per call on
the demo's block and ``mlp_small`` (``aot_eager``, an idle 2-core machine, one thread), Dynamo's
graph under eager's autograd 1.00-1.03x. So a user who compiles on a laptop before a GPU run loses
nothing, and gets eager's results, gradients included, because eager's ops are what run.

Where the pipeline is asked for, it still runs: under ``CGTREES_INTERPRET=1`` (kernels generated
and run on the CPU: how CI tests codegen), with the option ``cpu_pipeline`` (a model seen through
AOTAutograd, our partition, the runtime and the cache on a machine without a GPU: the CPU test suite
runs so), and when torch keeps the compiled function (``aot_compile``: precompile saves our
artifacts, which only the pipeline makes).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.utils import _pytree

from cgtrees import counters
from cgtrees.config import Config
from cgtrees.runtime import function as runtime_function
from cgtrees.runtime import skips


def applies(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: Config) -> bool:
    """Whether ``gm`` runs as captured: no tensor of it (inputs, or values its nodes make) is on a
    CUDA device, Triton is not interpreted and the pipeline is not asked for."""
    if config.interpret or config.cpu_pipeline:
        return False
    values = [*example_inputs, *(node.meta.get("example_value") for node in gm.graph.nodes)]
    return not any(isinstance(v, torch.Tensor) and v.device.type != "cpu" for v in _pytree.tree_leaves(values))


def call(gm: torch.fx.GraphModule, name: str) -> Callable[..., Any]:
    """Dynamo's graph itself, counted (``graphs_as_captured``) and, as every graph on CPU tensors,
    one ``cudagraph_skips`` with the reason."""
    counters.bump("graphs_as_captured")
    runtime_function.skip(name, skips.CPU_INPUTS)
    return gm.forward
