"""Small conv nets for the partitioner's measurements (tests/test_partition.py), in training mode:
batch norm's statistics, ReLU masks, residual adds, depthwise convolutions, LayerNorm and GELU."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBNReLU(nn.Module):
    """A stack of conv -> BatchNorm -> ReLU."""

    def __init__(self, c: int = 8, layers: int = 3) -> None:
        super().__init__()
        body: list[nn.Module] = []
        for i in range(layers):
            body += [nn.Conv2d(3 if i == 0 else c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()]
        self.body = nn.Sequential(*body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class BasicBlock(nn.Module):
    """ResNet's basic block: two conv/BN, ReLU, a residual add."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class MobileBlock(nn.Module):
    """MobileNetV2's inverted residual: 1x1 expand, 3x3 depthwise, 1x1 project, ReLU6."""

    def __init__(self, c: int = 8, expand: int = 16) -> None:
        super().__init__()
        self.expand, self.bn0 = nn.Conv2d(c, expand, 1, bias=False), nn.BatchNorm2d(expand)
        self.dw = nn.Conv2d(expand, expand, 3, padding=1, groups=expand, bias=False)
        self.bn1 = nn.BatchNorm2d(expand)
        self.project, self.bn2 = nn.Conv2d(expand, c, 1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu6(self.bn0(self.expand(x)))
        y = F.relu6(self.bn1(self.dw(y)))
        return self.bn2(self.project(y)) + x


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: 7x7 depthwise conv, LayerNorm over channels, MLP with GELU, layer scale."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.fc2(F.gelu(self.fc1(y))) * self.gamma
        return x + y.permute(0, 3, 1, 2)
