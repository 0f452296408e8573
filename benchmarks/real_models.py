"""The real-model suite of issue 16: library models with random weights, built from configs.

Each builder returns a workload as ``workloads.py`` defines it, ``(model, example_input_fn,
loss_fn)``, so the same worker, runner and report measure them. Sizes are fixed here:

| name | model | size | input |
|---|---|---|---|
| gpt2 | HF ``GPT2LMHeadModel`` | 4 layers, d=512, 8 heads, vocab 8192 | batch 8 x seq 128 token ids |
| llama | HF ``LlamaForCausalLM`` | 4 layers, d=512, 8 heads, 2 kv heads (GQA), ffn 1536, vocab 8192 | 8 x 128 |
| bert | HF ``BertForMaskedLM`` | 4 layers, d=512, 8 heads, ffn 2048, vocab 8192 | 8 x 128 |
| vit_tiny | timm ``vit_tiny_patch16_224`` | as published (12 layers, d=192) | batch 32, 3x224x224 |
| resnet18 | torchvision ``resnet18`` | as published | batch 32, 3x224x224 |
| mobilenet_v3_small | torchvision ``mobilenet_v3_small`` | as published, classifier dropout off | batch 32, 3x224x224 |
| convnext_atto | timm ``convnext_atto`` | as published (no dropout or drop-path by default) | batch 32, 3x224x224 |

The vocabulary is 8192, not the published 30-50k, so that at these small widths the blocks, not the
output projection, are most of the work. Dropout is off (a training step must be comparable with
eager's); the HF models use ``sdpa`` attention and the config's default ``use_cache`` (on for GPT-2 and
Llama, as a user gets it: the KV cache's lifted constant is in the graph), and are called with
token ids only. The model gives a tensor (logits); the loss is cross-entropy against fixed
random labels, computed outside the compiled model as the other workloads do.

transformers, timm and torchvision are imported only when a model is built: this module imports on
any machine. timm and torchvision import only on the GPU machine (on the CPU machine the torchvision
that matches torch is a CUDA build that fails to import); there, building ``vit_tiny`` or
``resnet18`` raises ``MissingPackage`` naming what is missing, and the row fails with that message.
``smoke=True`` gives tiny sizes that run on the CPU in seconds.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Workload = tuple[nn.Module, Callable[[torch.device], tuple], Callable[[torch.Tensor], torch.Tensor]]

VOCAB, SMOKE_VOCAB = 8192, 256
HF_MODELS = ("gpt2", "llama", "bert")  # need transformers only
NEEDS = {"gpt2": ("transformers",), "llama": ("transformers",), "bert": ("transformers",),
         "vit_tiny": ("timm", "torchvision"), "resnet18": ("torchvision",),
         "mobilenet_v3_small": ("torchvision",), "convnext_atto": ("timm", "torchvision")}


class MissingPackage(RuntimeError):
    """A model's library does not import on this machine."""


def _require(name: str) -> list[ModuleType]:
    """The packages model ``name`` needs, imported; ``MissingPackage`` if one does not import."""
    found = []
    for package in NEEDS[name]:
        try:
            found.append(importlib.import_module(package))
        except Exception as exc:  # a CUDA-only torchvision fails with OSError or RuntimeError, not only ImportError
            needs = "/".join(NEEDS[name])
            raise MissingPackage(f"{name} needs {needs}: {package} does not import here "
                                 f"({type(exc).__name__}: {str(exc)[:200]}); pip install {package} to run it") from exc
    return found


class Logits(nn.Module):
    """An HF model called with token ids only; returns its logits (the worker wants a tensor)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits


def _token_ids(vocab: int, batch: int, seq: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple:
        gen = torch.Generator().manual_seed(1234)
        return (torch.randint(vocab, (batch, seq), generator=gen).to(device),)
    return make


def _images(batch: int, size: int) -> Callable[[torch.device], tuple]:
    def make(device: torch.device) -> tuple:
        gen = torch.Generator().manual_seed(1234)
        return (torch.randn(batch, 3, size, size, generator=gen).to(device),)
    return make


def cross_entropy(classes: int, label_shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cross-entropy of logits ``(*label_shape, classes)`` against fixed random labels (one copy per device)."""
    labels: dict[torch.device, torch.Tensor] = {}

    def loss(logits: torch.Tensor) -> torch.Tensor:
        if logits.device not in labels:
            gen = torch.Generator().manual_seed(4321)
            labels[logits.device] = torch.randint(classes, label_shape, generator=gen).to(logits.device)
        return F.cross_entropy(logits.float().reshape(-1, classes), labels[logits.device].reshape(-1))
    return loss


def _lm_sizes(smoke: bool) -> dict:
    if smoke:
        return {"layers": 1, "dim": 32, "heads": 4, "kv_heads": 2, "vocab": SMOKE_VOCAB, "batch": 2, "seq": 16}
    return {"layers": 4, "dim": 512, "heads": 8, "kv_heads": 2, "vocab": VOCAB, "batch": 8, "seq": 128}


def _lm(model: nn.Module, s: dict) -> Workload:
    return Logits(model), _token_ids(s["vocab"], s["batch"], s["seq"]), \
        cross_entropy(s["vocab"], (s["batch"], s["seq"]))


# --- HF language models ----------------------------------------------------------------------

def gpt2(smoke: bool = False) -> Workload:
    (tf,) = _require("gpt2")
    s = _lm_sizes(smoke)
    config = tf.GPT2Config(n_layer=s["layers"], n_embd=s["dim"], n_head=s["heads"], vocab_size=s["vocab"],
                           n_positions=4 * s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    return _lm(tf.GPT2LMHeadModel(config), s)


def llama(smoke: bool = False) -> Workload:
    (tf,) = _require("llama")
    s = _lm_sizes(smoke)
    ffn = 64 if smoke else 1536  # 8/3 of d, rounded up to a multiple of 256, as Llama sizes it
    config = tf.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["dim"], num_attention_heads=s["heads"],
                            num_key_value_heads=s["kv_heads"], intermediate_size=ffn, vocab_size=s["vocab"],
                            max_position_embeddings=4 * s["seq"], attention_dropout=0.0, bos_token_id=0,
                            eos_token_id=0, pad_token_id=None, attn_implementation="sdpa")
    return _lm(tf.LlamaForCausalLM(config), s)


def bert(smoke: bool = False) -> Workload:
    (tf,) = _require("bert")
    s = _lm_sizes(smoke)
    config = tf.BertConfig(num_hidden_layers=s["layers"], hidden_size=s["dim"], num_attention_heads=s["heads"],
                           intermediate_size=4 * s["dim"], vocab_size=s["vocab"], max_position_embeddings=4 * s["seq"],
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                           attn_implementation="sdpa")
    return _lm(tf.BertForMaskedLM(config), s)


# --- vision models (timm and torchvision: GPU machine only) ------------------------------------

def vit_tiny(smoke: bool = False) -> Workload:
    timm, _ = _require("vit_tiny")
    batch, size, classes = (2, 32, 10) if smoke else (32, 224, 1000)
    extra = {"img_size": size, "depth": 2} if smoke else {}
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=classes, **extra)
    return model, _images(batch, size), cross_entropy(classes, (batch,))


def resnet18(smoke: bool = False) -> Workload:
    (tv,) = _require("resnet18")
    batch, size, classes = (2, 32, 10) if smoke else (32, 224, 1000)
    model = tv.models.resnet18(weights=None, num_classes=classes)
    return model, _images(batch, size), cross_entropy(classes, (batch,))


def mobilenet_v3_small(smoke: bool = False) -> Workload:
    (tv,) = _require("mobilenet_v3_small")
    batch, size, classes = (2, 32, 10) if smoke else (32, 224, 1000)
    # torchvision's default is dropout 0.2 before the last layer: eager's and the compiled step's
    # masks would differ and no gradient could be compared.
    model = tv.models.mobilenet_v3_small(weights=None, num_classes=classes, dropout=0.0)
    return model, _images(batch, size), cross_entropy(classes, (batch,))


def convnext_atto(smoke: bool = False) -> Workload:
    timm, _ = _require("convnext_atto")
    batch, size, classes = (2, 32, 10) if smoke else (32, 224, 1000)
    model = timm.create_model("convnext_atto", pretrained=False, num_classes=classes)
    return model, _images(batch, size), cross_entropy(classes, (batch,))


MODELS: dict[str, Callable[..., Workload]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit_tiny": vit_tiny,
    "resnet18": resnet18,
    "mobilenet_v3_small": mobilenet_v3_small,
    "convnext_atto": convnext_atto,
}
