"""The real-size suite (issue 44, item 3): the models at the sizes people train and serve them.

The own suite (``workloads.py``) and the real-model suite (``real_models.py``) hold small models,
where the host's overhead is most of a step. These are the published sizes, random weights:

| name | model | size | step | batch (per rank) | precision |
|---|---|---|---|---|---|
| gpt2_small | HF ``GPT2LMHeadModel(GPT2Config())`` | 12 x d768, vocab 50257: 124M | train | 8 x 1024 | bf16 autocast |
| bert_base | HF ``BertForMaskedLM(BertConfig())`` | 12 x d768, vocab 30522: 110M | train | 16 x 512 | bf16 autocast |
| vit_b16_infer | timm ``vit_base_patch16_224`` | 12 x d768: 86M | infer | 64 images 224x224 | bf16 weights |
| vit_b16_train | timm ``vit_base_patch16_224`` | 86M, 1000 classes | train | 32 images 224x224 | bf16 autocast |
| resnet50_train | torchvision ``resnet50`` | 25.6M | train | 64 images, channels_last | bf16 autocast |
| resnet50_infer | torchvision ``resnet50`` | 25.6M | infer | 1 image 224x224 | fp32 |
| llama_1b | HF ``LlamaForCausalLM(LlamaConfig(**LLAMA_1B))`` | 16 x d2048: 1.10B | train | 4 x 1024 | bf16 autocast |
| gpt2_small_ddp | gpt2_small, ``torch.compile(DDP(model))`` | 124M, 2 GPUs | train | 8 x 1024 a rank | bf16 autocast |

``LLAMA_1B``: 16 layers, hidden 2048, 32 heads, 8 kv heads, intermediate 8192, vocab 32000,
untied embeddings, 2048 positions, the config's defaults otherwise (RMSNorm eps 1e-6, rope theta
10000). The optimizer is AdamW (``fused=True``, lr 1e-4) except ResNet-50's SGD (``fused=True``,
momentum 0.9, lr 1e-3).

How each step runs, for every backend alike:

- **Training**: the forward under ``torch.autocast("cuda", torch.bfloat16)`` over float32 weights
  (master weights: the optimizer updates fp32), the loss, ``loss.backward()``, ``optimizer.step()``
  and ``optimizer.zero_grad(set_to_none=True)``: one optimizer step per step. The optimizer runs
  eagerly (never compiled), fused (``fused=True``), learning rate 1e-4 (1e-3 for SGD).
- **The loss**: the HF models compute it inside the compiled model, as a user of them does
  (``model(input_ids=ids, labels=labels).loss``; GPT-2 and Llama's labels are the input ids, which
  the model shifts; BERT's are the ids at 15% of positions, -100 elsewhere). The vision models
  return logits and the cross-entropy against fixed random labels is computed outside the
  compiled model, in the autocast region, as torchvision's and timm's training scripts do.
- **Inference** runs under ``torch.no_grad()``. ViT-B/16 inference runs with its weights and input
  cast to bf16 (``model.to(torch.bfloat16)``, no autocast), as it is served; ResNet-50 inference is
  fp32 at batch 1 (the latency case). torch's defaults for TF32 are kept (matmuls fp32, cuDNN
  convolutions TF32): no backend changes them.
- **Dropout** is off everywhere (GPT-2's resid/embd/attn pdrop, BERT's hidden and attention
  probabilities: its default is 0.1; timm and torchvision's defaults are 0 here), so that a compiled
  step's loss and gradients can be compared with eager's. HF attention is ``sdpa``; the KV cache is
  off (``use_cache=False``, as training scripts set it).
- **Llama at 1.1B in fp32 master weights** fits an 80 GB H100 at 4 x 1024: weights 4.4 GB,
  gradients 4.4 GB, AdamW's two moments 8.8 GB, bf16 activations about 8-12 GB (16 layers of
  4096 tokens) and the fp32 logits and their gradient (4096 x 32000: 0.5 GB each): about 30-40 GB
  at eager's peak, so bf16 weights are not needed.
- **DDP**: ``torch.compile(DDP(model))`` (DDPOptimizer splits the graph at the gradient buckets),
  one process per GPU, each with its own batch (seeded by its rank); it runs only where
  ``torch.cuda.device_count() >= 2``, else its row says skipped.

Inputs are seeded (token ids, images, labels), as are the weights (``torch.manual_seed(0)`` before
the model is built). ``smoke=True`` gives tiny configs of the same models that run on a CPU in
seconds (``size_run.py --smoke``): 1-2 layers at d=32-64, batch 2, 16 tokens or 32x32 images.

transformers, timm and torchvision are imported only when a model is built; a library that does
not import (timm and torchvision on the CPU machine) raises ``real_models.MissingPackage`` and the
row is skipped with its message.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from real_models import MissingPackage

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 2048,
            "tie_word_embeddings": False}  # rms_norm_eps, rope theta (10000): the config's defaults
SMOKE_LM = {"layers": 1, "dim": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 256, "batch": 2, "seq": 16}


@dataclass(frozen=True)
class Spec:
    """One row of the suite's table: what it is, what it needs, how it is measured."""

    mode: str  # "train" or "infer"
    needs: tuple[str, ...]  # packages that must import
    sizes: str  # per step (per rank), as the report prints it
    precision: str
    world: int = 1  # processes (GPUs) of a DDP row


SUITE: dict[str, Spec] = {
    "gpt2_small": Spec("train", ("transformers",), "124M, 8 x 1024 tok", "bf16 autocast"),
    "bert_base": Spec("train", ("transformers",), "110M, 16 x 512 tok", "bf16 autocast"),
    "vit_b16_infer": Spec("infer", ("timm", "torchvision"), "86M, 64 img 224", "bf16 weights"),
    "vit_b16_train": Spec("train", ("timm", "torchvision"), "86M, 32 img 224", "bf16 autocast"),
    "resnet50_train": Spec("train", ("torchvision",), "25.6M, 64 img 224, NHWC", "bf16 autocast"),
    "resnet50_infer": Spec("infer", ("torchvision",), "25.6M, 1 img 224", "fp32"),
    "llama_1b": Spec("train", ("transformers",), "1.1B, 4 x 1024 tok", "bf16 autocast"),
    "gpt2_small_ddp": Spec("train", ("transformers",), "124M, 2 x 8 x 1024 tok", "bf16 autocast", world=2),
}
MODELS = tuple(SUITE)


@dataclass
class Case:
    """A built model and how one step calls it.

    ``forward(fn)`` calls ``fn`` (the model, compiled or not) on the fixed inputs and returns the
    loss (training) or the output (inference); the worker wraps it in autocast, no_grad, backward
    and the optimizer. ``items``: tokens or images per step (per rank)."""

    model: nn.Module
    forward: Callable[[Callable], torch.Tensor]
    train: bool
    autocast: bool
    items: int
    unit: str  # "tokens" or "images"
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


def build(name: str, device: torch.device, smoke: bool = False, rank: int = 0) -> Case:
    """Model ``name`` (seeded), built on ``device`` (a 1.1B model's initialisation is seconds on a CPU),
    with its inputs there; ``rank`` seeds a DDP rank's batch."""
    require(name)
    torch.manual_seed(0)
    with device:
        case = BUILDERS[name.removesuffix("_ddp")](device, smoke, 1234 + rank)
    case.model.train(case.train)
    return case


def require(name: str) -> list[ModuleType]:
    """The packages model ``name`` needs, imported; ``MissingPackage`` naming the first that does not import."""
    found = []
    for package in SUITE[name].needs:
        try:
            found.append(importlib.import_module(package))
        except Exception as exc:  # a CUDA-only torchvision fails with OSError or RuntimeError, not only ImportError
            raise MissingPackage(f"{name} needs {'/'.join(SUITE[name].needs)}: {package} does not import here "
                                 f"({type(exc).__name__}: {str(exc)[:200]}); pip install {package} to run it") from exc
    return found


def _gen(seed: int) -> torch.Generator:
    """Inputs come from the CPU's generator (the same on every device), made on the CPU: ``build``
    runs under the model's device as the default."""
    return torch.Generator(device="cpu").manual_seed(seed)


def adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, fused=True)


# --- HF language models: the loss inside the model --------------------------------------------

def _lm_case(model: nn.Module, device: torch.device, batch: int, seq: int, vocab: int, seed: int,
             masked: bool = False) -> Case:
    model.to(device)
    ids = torch.randint(vocab, (batch, seq), generator=_gen(seed), device="cpu")
    if masked:  # BERT's masked LM: predict 15% of positions, the others ignored (-100)
        masked_at = torch.rand(batch, seq, generator=_gen(seed + 1), device="cpu") < 0.15
        labels = torch.where(masked_at, ids, torch.full_like(ids, -100))
    else:  # causal LM: the model shifts the labels itself
        labels = ids
    ids, labels = ids.to(device), labels.to(device)

    def forward(fn: Callable) -> torch.Tensor:
        return fn(input_ids=ids, labels=labels).loss
    return Case(model, forward, train=True, autocast=True, items=batch * seq, unit="tokens", optimizer=adamw)


def gpt2_small(device: torch.device, smoke: bool, seed: int) -> Case:
    (tf,) = require("gpt2_small")
    s = SMOKE_LM
    sizes = dict(n_layer=s["layers"], n_embd=s["dim"], n_head=s["heads"], vocab_size=s["vocab"],
                 n_positions=4 * s["seq"]) if smoke else {}
    config = tf.GPT2Config(**sizes, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           attn_implementation="sdpa")
    batch, seq = (s["batch"], s["seq"]) if smoke else (8, 1024)
    model = tf.GPT2LMHeadModel(config)
    # GPT-2's loss_type is None, so transformers' loss_function warns once, where Dynamo breaks the
    # graph for every backend; "ForCausalLM" (the loss it then takes anyway) keeps one graph
    model.loss_type = os.environ.get("REAL_SIZES_GPT2_LOSS_TYPE", model.loss_type)
    return _lm_case(model, device, batch, seq, config.vocab_size, seed)


def bert_base(device: torch.device, smoke: bool, seed: int) -> Case:
    (tf,) = require("bert_base")
    s = SMOKE_LM
    sizes = dict(num_hidden_layers=s["layers"], hidden_size=s["dim"], num_attention_heads=s["heads"],
                 intermediate_size=s["ffn"], vocab_size=s["vocab"], max_position_embeddings=4 * s["seq"]) \
        if smoke else {}
    config = tf.BertConfig(**sizes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           attn_implementation="sdpa")
    batch, seq = (s["batch"], s["seq"]) if smoke else (16, 512)
    return _lm_case(tf.BertForMaskedLM(config), device, batch, seq, config.vocab_size, seed, masked=True)


def llama_1b(device: torch.device, smoke: bool, seed: int) -> Case:
    (tf,) = require("llama_1b")
    s = SMOKE_LM
    sizes = dict(hidden_size=s["dim"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                 num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], vocab_size=s["vocab"],
                 max_position_embeddings=4 * s["seq"], tie_word_embeddings=False) if smoke else LLAMA_1B
    config = tf.LlamaConfig(**sizes, attention_dropout=0.0, use_cache=False, attn_implementation="sdpa")
    batch, seq = (s["batch"], s["seq"]) if smoke else (4, 1024)
    return _lm_case(tf.LlamaForCausalLM(config), device, batch, seq, config.vocab_size, seed)


# --- vision models: logits out, the loss outside ------------------------------------------------

def _vision_case(model: nn.Module, device: torch.device, batch: int, size: int, classes: int, seed: int,
                 train: bool, dtype: torch.dtype = torch.float32, channels_last: bool = False,
                 optimizer: Callable | None = None) -> Case:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model.to(device=device, dtype=dtype, memory_format=fmt)
    images = torch.randn(batch, 3, size, size, generator=_gen(seed), device="cpu")
    images = images.to(device=device, dtype=dtype, memory_format=fmt)
    labels = torch.randint(classes, (batch,), generator=_gen(seed + 1), device="cpu").to(device)

    def forward(fn: Callable) -> torch.Tensor:
        out = fn(images)
        return F.cross_entropy(out, labels) if train else out
    return Case(model, forward, train=train, autocast=train, items=batch, unit="images", optimizer=optimizer)


def _vit(smoke: bool) -> nn.Module:
    timm, _ = require("vit_b16_train")
    small = {"img_size": 32, "depth": 1, "embed_dim": 64, "num_heads": 4, "num_classes": 10} if smoke else {}
    return timm.create_model("vit_base_patch16_224", pretrained=False, **small)


def vit_b16_infer(device: torch.device, smoke: bool, seed: int) -> Case:
    batch, size, classes = (2, 32, 10) if smoke else (64, 224, 1000)
    return _vision_case(_vit(smoke), device, batch, size, classes, seed, train=False, dtype=torch.bfloat16)


def vit_b16_train(device: torch.device, smoke: bool, seed: int) -> Case:
    batch, size, classes = (2, 32, 10) if smoke else (32, 224, 1000)
    return _vision_case(_vit(smoke), device, batch, size, classes, seed, train=True, optimizer=adamw)


def _resnet50(smoke: bool) -> nn.Module:
    (tv,) = require("resnet50_train")
    return tv.models.resnet50(weights=None, num_classes=10 if smoke else 1000)


def resnet50_train(device: torch.device, smoke: bool, seed: int) -> Case:
    # Smoke: 4 images of 64x64, so that the last stage's batch norm sees 16 values per channel; over
    # 2 (2 images of 32x32 end 1x1) its gradients are ~1e10 and no two programs agree on them.
    batch, size, classes = (4, 64, 10) if smoke else (64, 224, 1000)
    return _vision_case(_resnet50(smoke), device, batch, size, classes, seed, train=True, channels_last=True,
                        optimizer=sgd)


def resnet50_infer(device: torch.device, smoke: bool, seed: int) -> Case:
    size, classes = (32, 10) if smoke else (224, 1000)
    return _vision_case(_resnet50(smoke), device, 1, size, classes, seed, train=False)


BUILDERS: dict[str, Callable[[torch.device, bool, int], Case]] = {
    "gpt2_small": gpt2_small, "bert_base": bert_base, "vit_b16_infer": vit_b16_infer,
    "vit_b16_train": vit_b16_train, "resnet50_train": resnet50_train, "resnet50_infer": resnet50_infer,
    "llama_1b": llama_1b,
}
