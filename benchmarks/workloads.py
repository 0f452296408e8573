"""The benchmark workloads of issue 6: fixed sizes, fp32, built deterministically from a seed.

Each builder returns ``(model, example_input_fn, loss_fn)``:
- ``model`` is an ``nn.Module`` on the CPU (the worker moves it to the device);
- ``example_input_fn(device)`` returns the tuple of positional inputs, the same on every call;
- ``loss_fn(output)`` reduces the output to a scalar for training.
``smoke=True`` gives tiny sizes that run on the CPU in well under a second.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import real_models

Workload = tuple[nn.Module, Callable[[torch.device], tuple], Callable[[torch.Tensor], torch.Tensor]]


def _randn_fn(*shape: int) -> Callable[[torch.device], tuple]:
    """Inputs drawn from their own generator, so they do not depend on the model's draws."""
    def make(device: torch.device) -> tuple:
        gen = torch.Generator().manual_seed(1234)
        return (torch.randn(*shape, generator=gen).to(device),)
    return make


def mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


# --- mlp_small: launch-bound -----------------------------------------------------------------

def mlp_small(smoke: bool = False) -> Workload:
    width, depth, batch = (32, 2, 4) if smoke else (256, 8, 16)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    layers.append(nn.Linear(width, 16))
    return nn.Sequential(*layers), _randn_fn(batch, width), mean_square


# --- norm_act: bandwidth-bound ---------------------------------------------------------------

class NormAct(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.norm2 = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.norm1(x)) * torch.sigmoid(x) + x
        return torch.softmax(self.norm2(y), dim=-1) * 2 + torch.tanh(y)


def norm_act(smoke: bool = False) -> Workload:
    rows, width = (64, 96) if smoke else (8192, 4096)
    return NormAct(width), _randn_fn(rows, width), mean_square


# --- gpt_block: two GPT-2 blocks, attention written out --------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(self.mask[:seq, :seq], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, seq)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def gpt_block(smoke: bool = False) -> Workload:
    batch, seq, dim, heads = (2, 16, 32, 4) if smoke else (8, 256, 768, 12)
    model = nn.Sequential(*(GPTBlock(dim, heads, seq) for _ in range(2)))
    return model, _randn_fn(batch, seq, dim), mean_square


# --- convnet: small ResNet-style net ---------------------------------------------------------

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def convnet(smoke: bool = False) -> Workload:
    batch, size, widths = (2, 16, (8, 16)) if smoke else (32, 64, (32, 64, 128))
    stem = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
    layers: list[nn.Module] = [stem, nn.BatchNorm2d(widths[0]), nn.ReLU()]
    cin = widths[0]
    for i, cout in enumerate(widths):
        layers += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10)]
    return nn.Sequential(*layers), _randn_fn(batch, 3, size, size), mean_square


# --- decode: one step of a 4-layer transformer with a static KV cache ------------------------

class DecodeLayer(nn.Module):
    """Writes this step's key and value into the cache at ``pos``, then attends over the cache."""

    def __init__(self, dim: int, heads: int, max_pos: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        shape = (1, heads, max_pos, dim // heads)
        # Earlier steps' keys and values: random, so the attention reads real numbers.
        self.register_buffer("k_cache", torch.randn(shape))
        self.register_buffer("v_cache", torch.randn(shape))
        self.register_buffer("positions", torch.arange(max_pos))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        batch, _, dim = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(dim, dim=-1)
        q, k, v = (t.view(batch, 1, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        scores = (q @ self.k_cache.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(self.positions > pos, float("-inf"))
        att = torch.softmax(scores, dim=-1) @ self.v_cache
        x = x + self.proj(att.transpose(1, 2).reshape(batch, 1, dim))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_pos: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecodeLayer(dim, heads, max_pos) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.embed(token)
        for layer in self.layers:
            x = layer(x, pos)
        return self.head(self.ln(x))


def decode(smoke: bool = False) -> Workload:
    vocab, dim, heads, max_pos = (64, 32, 4, 16) if smoke else (8192, 512, 8, 512)
    model = Decoder(vocab, dim, heads, layers=4, max_pos=max_pos)

    def inputs(device: torch.device) -> tuple:
        # Half the cache filled is the typical step; the position is data, not a shape.
        return torch.tensor([[7]], device=device), torch.tensor([max_pos // 2], device=device)

    return model, inputs, mean_square


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "mlp_small": mlp_small,
    "norm_act": norm_act,
    "gpt_block": gpt_block,
    "convnet": convnet,
    "decode": decode,
}
INFER_ONLY = {"decode"}


NAMES = (*WORKLOADS, *real_models.MODELS)  # our own workloads, then the real-model suite's


def build(name: str, smoke: bool = False, seed: int = 0) -> Workload:
    """The same weights for the same (name, smoke, seed), in any process (a real model's too)."""
    torch.manual_seed(seed)
    return {**WORKLOADS, **real_models.MODELS}[name](smoke=smoke)
