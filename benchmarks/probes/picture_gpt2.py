"""The picture of the CUDA graph trees in README.md (``docs/tree-gpt2.svg``): HF GPT-2 small (124M,
random weights) trained at batch 4 x 256 under bf16 autocast, each step followed by a look at the
model's next-token logits for a prompt, 32 tokens after even steps and 64 after odd ones. Each
prompt length is a graph of its own (``dynamic=False``): its first call warms up, its second records,
and the recordings made after the same backward in different steps are siblings, one branch a step.

    python benchmarks/probes/picture_gpt2.py OUT.dot     (on the GPU machine; render: dot -Tsvg)
"""

from __future__ import annotations

import sys

import torch
import transformers

from cgtrees.runtime import picture


def main(out: str) -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).cuda()
    compiled = torch.compile(model, backend="cgtrees", dynamic=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, config.vocab_size, (4, 256), device="cuda")
    for step in range(8):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            compiled(input_ids=ids[:1, : 64 if step % 2 else 32]).logits[:, -1].argmax(-1)
    torch.cuda.synchronize()
    print(f"wrote {picture.write(out)}")


if __name__ == "__main__":
    main(sys.argv[1])
