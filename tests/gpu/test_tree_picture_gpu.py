"""The picture of a real training loop's trees (issue 54, item 8): one box per recording, with its
shape, why it was recorded, its replays and pool bytes; backward after forward as parent and child."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

from cgtrees.runtime import picture

pytestmark = pytest.mark.usefixtures("kernel_modules")


def test_a_training_loop_draws_its_recordings_and_their_replays():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
    f = torch.compile(model, backend="cgtrees")
    for _ in range(6):
        f(torch.randn(16, 32, device="cuda")).square().sum().backward()
        model.zero_grad(set_to_none=True)
    with torch.no_grad():
        for batch in (16, 4):  # a second function, and a second shape of it
            for _ in range(3):
                f(torch.randn(batch, 32, device="cuda"))
    text = picture.dot()
    boxes = re.findall(r'^\s*n(\d+) \[label="((?:[^"\\]|\\.)*)"\];$', text, re.M)  # boxes, not edges
    assert boxes, text
    kinds = {label.split(" (")[1].split(")")[0] for _, label in boxes}
    assert {"forward", "backward", "inference"} <= kinds, text
    forward = next(i for i, label in boxes if "(forward)" in label)
    backward = next(i for i, label in boxes if "(backward)" in label)
    assert f"n{forward} -> n{backward}" in text, text  # the backward ran after its forward
    assert all("recorded: " in label and "replays " in label and " MiB" in label for _, label in boxes), text
    assert any(int(re.search(r"replays (\d+)", label).group(1)) >= 3 for _, label in boxes), text
