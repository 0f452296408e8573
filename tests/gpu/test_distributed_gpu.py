"""Data-parallel training with cgtrees on two GPUs (issue 21): NCCL, one GPU a rank, CUDA graphs.

The cases of tests/test_distributed.py (``distributed_helpers``) on CUDA: ``DDP(torch.compile(m))``
and ``torch.compile(DDP(m))``, one graph and DDPOptimizer's four pieces, trained five steps in
eager DDP and with cgtrees on the same per-rank data. Beyond eager's gradients and parameters,
every function of ours (each piece's forward and backward, the eval pieces' inference graphs) is
recorded and replayed in CUDA graphs: no skip, no fallback, at least one replay each, and one tree
a rank (the backward pieces run in their forwards' tree; DDP's all-reduce hooks run between them,
outside any graph). Skipped unless two GPUs and NCCL are there.

Tolerance (``TOL``, relative to each tensor's largest eager entry): the matrix products are
cuBLAS's, as in eager; generated reductions add in another order (a bias gradient sums 16 rows,
a row of an input gradient 64 or 512 products): up to length x float32 eps, 512 x 1.2e-7 = 6e-5
at worst, far less in practice; SGD carries it into the next steps. A skipped, doubled or stale
all-reduce is off by the gradients' own size.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from distributed_helpers import assert_close_reports, run_cases

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_available()
    or not dist.is_nccl_available(), reason="needs two CUDA GPUs and NCCL")

TOL = 6e-5
STEPS = 5  # warmup, record, then replays
DDP_CASES = ["ddp_of_compiled", "no_sync", "bucket_view", "compiled_ddp", "compiled_ddp_buckets",
             "ddp_of_compiled_buckets"]
FSDP_CASES = ["fsdp2_root", "fsdp2_layers"]
CASES = DDP_CASES + FSDP_CASES


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    env = {"CGTREES_CACHE_DIR": str(tmp_path_factory.mktemp("dist_cache"))}
    return run_cases(CASES, "cuda", env, timeout_s=540, steps=STEPS)


def replays_by_function(describe: str) -> dict[str, int]:
    """Replays of each function's nodes (``function gN_kind`` lines name every function that ran)."""
    functions = {m.group(1): 0 for m in re.finditer(r"^function (g\d+_\w+) ", describe, re.M)}
    for m in re.finditer(r"node \d+ (g\d+_\w+) .*?replays=(\d+)", describe):
        functions[m.group(1)] = functions.get(m.group(1), 0) + int(m.group(2))
    return functions


@pytest.mark.parametrize("case", CASES)
def test_eager_results(reports, case):
    for rank, by_case in enumerate(reports):
        assert_close_reports(by_case[case], TOL, f"{case}, rank {rank}")


@pytest.mark.parametrize("case", DDP_CASES)
def test_every_function_replays(reports, case):
    for rank, by_case in enumerate(reports):
        report = by_case[case]
        c = report.counters
        assert not c.get("cudagraph_skips") and not c.get("graph_fallbacks"), (rank, c, report.describe)
        assert "no CUDA graphs" not in report.describe, report.describe
        replays = replays_by_function(report.describe)
        assert replays and all(n > 0 for n in replays.values()), (rank, replays, report.describe)
        assert report.describe.count("tree cuda:") == 1, report.describe  # one tree a rank


@pytest.mark.parametrize("case", ["compiled_ddp_buckets", "ddp_of_compiled_buckets"])
def test_pieces(reports, case):
    """Four pieces, each a forward and a backward of ours (and, for the eval forward of the
    compiled-DDP case, four inference pieces)."""
    pieces = 8 if case == "compiled_ddp_buckets" else 4
    for by_case in reports:
        report = by_case[case]
        assert report.counters.get("ddp_pieces") == pieces, report.counters
        kinds = [re.match(r"g\d+_(\w+?)(_\d+)?$", name).group(1) for name in replays_by_function(report.describe)]
        assert kinds.count("forward") == 4 and kinds.count("backward") == 4, report.describe


@pytest.mark.parametrize("case", FSDP_CASES)
def test_fsdp2_graphs_or_reasons(reports, case):
    """FSDP2 frees each unsharded parameter after the forward and gathers it again: a parameter
    (a static input) may come back at another address, which re-records, and past
    max_rerecords_per_function runs without graphs. Either way eager's results
    (test_eager_results); here: no fallback, and every function replays or says why it does not."""
    for rank, by_case in enumerate(reports):
        report = by_case[case]
        assert not report.counters.get("graph_fallbacks"), (rank, report.counters)
        replays = replays_by_function(report.describe)
        disabled = set(re.findall(r"^function (g\d+_\w+) .*no CUDA graphs: ", report.describe, re.M))
        silent = [name for name, n in replays.items() if n == 0 and name not in disabled]
        assert not silent, (rank, silent, report.describe)
