"""R6 for a mutated input the program does not mark static (issue 45: a KV cache made inside
compiled code): at the address it had at the shape's warmup, it is written where it is; a new one
(a new cache) is written where it is by a new recording; one that moves at every call is copied
into a slot from then on. Static inputs that move at every call (FSDP2's parameters) are copied
too, so the function replays. Results, and the mutated inputs, as eager's."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import cgtrees.runtime as runtime

DEV = "cuda"
pytestmark = pytest.mark.usefixtures("kernel_modules")


def stat(key: str) -> int:
    return counters["cgtrees"][key]


def step(cache: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A decode step's shape: write x at ``pos`` of the cache, read the whole cache."""
    cache.index_copy_(0, pos, x)
    return (cache * 2).sum(0)


HELD = []  # every step's new token stays alive: each is at a new address, so it is copied


def _run(f, cache, ref_cache, pos, steps: int, start: int = 0) -> None:
    for i in range(start, start + steps):
        x = torch.randn(1, 64, device=DEV)
        HELD.append(x)
        pos.fill_(i)
        torch.compiler.cudagraph_mark_step_begin()  # a decode loop's step: the last output is dead
        out, want = f(cache, pos, x), step(ref_cache, pos.clone(), x)
        torch.testing.assert_close(out, want, msg=lambda m: f"{m}\n{runtime.describe()}")
        torch.testing.assert_close(cache, ref_cache)
        del out


def test_mutated_input_at_one_address_is_written_in_place():
    cache, ref = torch.zeros(32, 64, device=DEV), torch.zeros(32, 64, device=DEV)
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    f = torch.compile(step, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        _run(f, cache, ref, pos, 8)
    text = runtime.describe()
    assert stat("cudagraph_recorded") == 1 and stat("cudagraph_replayed") == 6, text
    assert "inputs copied=2 checked=1" in text, text  # the cache is checked; x and pos are copied


def test_a_new_cache_is_written_in_place_by_a_new_recording():
    """A new cache per generation (at a new address: the old ones are kept) records once more, the
    cache written in place again; no limit counts it (the function keeps its graphs)."""
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    f = torch.compile(step, backend="cgtrees", options={"cache": False, "max_rerecords_per_function": 0})
    kept = []
    with torch.no_grad():
        for _ in range(3):
            cache, ref = torch.zeros(32, 64, device=DEV), torch.zeros(32, 64, device=DEV)
            _run(f, cache, ref, pos, 6)
            kept.append(cache)
    text = runtime.describe()
    assert stat("cudagraph_skips") == 0 and "no CUDA graphs" not in text, text
    assert stat("cudagraph_recorded") == 3 and stat("cudagraph_replayed") == 18 - 1 - 3, text
    assert text.count("inputs copied=2 checked=1") == 3, text  # each writes its cache in place
    assert "2 an input read or written in place moved" in text, text


def test_a_cache_moving_every_call_is_copied():
    """Recorded in place, then another cache at every call: the recording never replayed, so the
    cache is copied into a slot (and written back) from then on: one more recording, then replays."""
    caches = [torch.zeros(32, 64, device=DEV) for _ in range(2)]
    refs = [torch.zeros(32, 64, device=DEV) for _ in range(2)]
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    f = torch.compile(step, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        for i, which in enumerate([0, 0] + [1, 0] * 4):
            _run(f, caches[which], refs[which], pos, 1, start=i)
    text = runtime.describe()
    assert stat("cudagraph_recorded") == 2 and stat("cudagraph_replayed") == 10 - 3, text
    assert re.search(r"inputs \[\d+\] copied after they moved", text), text


def test_alternating_addresses_stay_right():
    """Two caches used in turn (double buffering): never a replay over the other one's memory."""
    caches = [torch.zeros(32, 64, device=DEV) for _ in range(2)]
    refs = [torch.zeros(32, 64, device=DEV) for _ in range(2)]
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    f = torch.compile(step, backend="cgtrees", options={"cache": False})
    with torch.no_grad():
        for i in range(12):
            _run(f, caches[i % 2], refs[i % 2], pos, 1, start=i // 2)
    assert stat("cudagraph_skips") == 0 and stat("cudagraph_replayed") >= 8, runtime.describe()


def test_parameters_that_move_every_call_are_copied():
    """FSDP2 frees each unsharded parameter's memory after use and gathers it again before the next
    (``storage.resize_``): the Parameter and its storage live on, at a new address every call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)
    eager = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64)).to(DEV)
    eager.load_state_dict(model.state_dict())
    f = torch.compile(model, backend="cgtrees", options={"cache": False})
    hold = []  # what takes each freed block, so the gathered parameter lands elsewhere
    with torch.no_grad():
        for _ in range(8):
            for p in model.parameters():  # gathered again: same values, another address
                values, storage = p.detach().clone(), p.untyped_storage()
                nbytes = storage.nbytes()
                storage.resize_(0)
                hold.append(torch.empty(nbytes, dtype=torch.uint8, device=DEV))
                storage.resize_(nbytes)
                p.copy_(values)
            x = torch.randn(16, 64, device=DEV)
            torch.testing.assert_close(f(x), eager(x), msg=lambda m: f"{m}\n{runtime.describe()}")
    text = runtime.describe()
    assert stat("cudagraph_replayed") >= 3 and "no CUDA graphs" not in text, text


def _backward_copies(grads: str) -> tuple[int, list[int]]:
    """Six training steps of a linear layer, each backward given a 4 MiB gradient: the same tensor
    each step ("same"); a new one at the first step (the warmup), then one tensor ("settles": as
    autograd's zero gradient for an unused output, elsewhere once the optimizer's state exists); or
    a new one each step that stays alive, so at a new address ("fresh"). Outputs and gradients
    against eager's. The recordings made, and the inputs each backward recording copies into slots."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    head = nn.Linear(64, 4096, device=DEV)
    ref = copy.deepcopy(head)
    f = torch.compile(head, backend="cgtrees", options={"cache": False})
    x, grad, kept = torch.randn(256, 64, device=DEV), torch.randn(256, 4096, device=DEV), []
    for i in range(6):
        g = grad.clone() if grads == "fresh" or (grads == "settles" and i == 0) else grad
        kept.append(g)
        out, want = f(x), ref(x)
        out.backward(g)
        want.backward(g)
        torch.testing.assert_close(out, want)
        for p, q in zip(head.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4 * q.grad.abs().max().item())
            p.grad = q.grad = None
        del out
    text = runtime.describe()
    assert stat("cudagraph_replayed") >= 6 and stat("cudagraph_skips") == 0, text
    copies = [int(n) for n in re.findall(r"backward\S* .*?inputs copied=(\d+)", text)]
    return stat("cudagraph_recorded"), copies


def test_a_large_input_is_read_in_place(no_tf32):
    """An input of 1 MiB or more is read where it is, checked at each call, like a KV cache (copied
    into a slot, each replay reads and writes all of it), also when it settles at its address only
    after the warmup. One at a new address each call costs one more recording, then is copied."""
    same, settles, fresh = (_backward_copies(g) for g in ("same", "settles", "fresh"))
    assert same[0] == settles[0] == 2 and fresh[0] == 3, (same, settles, fresh)
    assert same[1] == settles[1] and len(same[1]) == 1, (same, settles)
    assert fresh[1][-1] == same[1][0] + 1, (same, fresh)  # the newest recording copies the gradient
