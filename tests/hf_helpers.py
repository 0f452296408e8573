"""Tiny Hugging Face ``transformers`` models (random weights, built from configs) and the checks that
compare a model compiled with ``backend="cgtrees"`` against eager on a deep copy.

Nothing is downloaded: no weights, no tokenizers; token ids are random. Every config leaves the
model's own defaults where they matter (``use_cache``, the attention implementation, which is
``sdpa``) and sets every dropout to 0, so eager and compiled runs are deterministic.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch._dynamo

VOCAB, BATCH, SEQ, TARGET_SEQ = 100, 2, 12, 8
MELS = 8  # Whisper's feature channels


@dataclass(frozen=True)
class Case:
    """A model builder and the inputs of one training call (labels included: the model returns a loss)."""

    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    seq2seq: bool = False
    graph_breaks: bool = False  # the model breaks the graph on purpose (a Python loop over nonzero())

    def inference_inputs(self) -> dict[str, torch.Tensor]:
        """No labels (an encoder-decoder gets its decoder's ids instead), so nothing turns off the KV
        cache: BART, for one, sets ``use_cache=False`` when it is given labels."""
        inputs = self.inputs()
        labels = inputs.pop("labels")
        if self.seq2seq:
            inputs["decoder_input_ids"] = _ids(*labels.shape)
        return inputs


def _ids(*shape: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape)  # ids 0-2 are the special tokens below


def _padding_mask() -> torch.Tensor:
    """The second sequence is right-padded by 3 tokens, so the padding path of the mask is used."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    return mask


def _causal_lm_inputs() -> dict[str, torch.Tensor]:
    ids, mask = _ids(BATCH, SEQ), _padding_mask()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _masked_lm_inputs() -> dict[str, torch.Tensor]:
    ids, mask = _ids(BATCH, SEQ), _padding_mask()
    picked = (torch.arange(SEQ) % 3 == 1).expand(BATCH, SEQ) & (mask == 1)  # every third real token
    return {"input_ids": ids.masked_fill(picked, 2), "attention_mask": mask,
            "labels": ids.masked_fill(~picked, -100)}


def _seq2seq_inputs() -> dict[str, torch.Tensor]:
    labels = _ids(BATCH, TARGET_SEQ)
    labels[1, -2:] = -100
    return {"input_ids": _ids(BATCH, SEQ), "attention_mask": _padding_mask(), "labels": labels}


def _special(pad: int = 0, bos: int = 1, eos: int = 2) -> dict[str, int]:
    return {"pad_token_id": pad, "bos_token_id": bos, "eos_token_id": eos}


def _gpt2() -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **_special()))


def _llama() -> torch.nn.Module:
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(  # grouped-query attention: 4 heads, 2 kv heads
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **_special()))


def _qwen2() -> torch.nn.Module:
    import transformers

    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **_special()))


def _bert() -> torch.nn.Module:
    import transformers

    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        pad_token_id=0))


def _roformer() -> torch.nn.Module:
    """Rotary embeddings written with interleaved pairs (``stack([sin, sin], -1)``): indices ``x // 2``,
    whose stride the scheduler asked of sympy and compared (fixed 2026-11-29: the backward had gone
    through aten)."""
    import transformers

    return transformers.RoFormerForMaskedLM(transformers.RoFormerConfig(
        vocab_size=VOCAB, hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0))


def _t5() -> torch.nn.Module:
    import transformers

    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        decoder_start_token_id=0, **_special()))


def _bart() -> torch.nn.Module:
    import transformers

    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, decoder_start_token_id=2,
        forced_eos_token_id=None, **_special(pad=1, bos=0, eos=2)))


def _decoder(model: str, config: str, **extra: Any) -> Callable[[], torch.nn.Module]:
    """A two-layer decoder of transformers' class ``model``, its config at the sizes of the rest."""
    def build() -> torch.nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, **extra, **_special()))
    return build


# Decoders users bring, each for what it adds: a sliding-window mask (Mistral), fused q/k/v and
# gate/up projections (Phi-3), RMSNorm on q and k (Qwen3), tanh soft-capping of attention and logits,
# norms around each block and a window on every other layer (Gemma 2), rotary embedding on part of
# each head and a parallel residual (GPT-NeoX)
_mistral = _decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=8)
_phi3 = _decoder("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2)
_qwen3 = _decoder("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8)
_gemma2 = _decoder("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8, sliding_window=8)
_gpt_neox = _decoder("GPTNeoXForCausalLM", "GPTNeoXConfig", rotary_pct=0.5, hidden_dropout=0.0,
                     attention_dropout=0.0)


def _mixtral() -> torch.nn.Module:
    """Mixture of experts with transformers' eager experts: a Python loop over the experts that
    ``nonzero()`` found, each step an index_add_ into a buffer made by ``zeros_like`` (graph breaks)."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=4, num_experts_per_tok=2,
        **_special())
    config._experts_implementation = "eager"
    return transformers.MixtralForCausalLM(config)


def _bloom() -> torch.nn.Module:
    """ALiBi: a per-head linear bias on the attention logits (``baddbmm``, transformers' own attention),
    a LayerNorm on the embeddings, q/k/v fused per head."""
    import transformers

    return transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        **_special()))


def _falcon() -> torch.nn.Module:
    """Falcon-7B's layout: multi-query attention (one key/value head), attention and MLP in parallel
    on one LayerNorm, rotary positions, no biases."""
    import transformers

    return transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, alibi=False, bias=False, max_position_embeddings=32,
        hidden_dropout=0.0, attention_dropout=0.0, **_special()))


def _deberta_v2() -> torch.nn.Module:
    """Disentangled attention: content-to-position and position-to-content logits, gathered from
    log-bucketed relative positions."""
    import transformers

    return transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=32, relative_attention=True, position_buckets=8, max_relative_positions=16,
        pos_att_type=["p2c", "c2p"], hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0))


def _whisper() -> torch.nn.Module:
    """Two 1-d convolutions (the second strided) before the encoder, sinusoidal positions there."""
    import transformers

    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=SEQ, max_target_positions=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None,
        **_special()))


def _speech_inputs() -> dict[str, torch.Tensor]:
    """Whisper's encoder takes 2 * max_source_positions frames of log-mel features (its conv halves them)."""
    labels = _ids(BATCH, TARGET_SEQ)
    labels[1, -2:] = -100
    return {"input_features": torch.randn(BATCH, MELS, 2 * SEQ), "labels": labels}


# More decoders, each for what it adds: attention and MLP in parallel, LayerNorm without a bias,
# rotary embedding on interleaved pairs, q/k LayerNorm and a logit scale (Cohere); a whole-graph
# mixture of experts: tokens sorted by expert, counted by ``histc``, transformers' grouped matmul, and a
# shared expert behind a sigmoid gate (Qwen2-MoE); learned per-head attention sinks, YaRN rotary, experts
# with biases and a clamped SwiGLU (GPT-OSS); multi-head latent attention (low-rank q and kv, rotary on
# part of each head) and group-limited routing after a dense first layer (DeepSeek-V3)
_cohere = _decoder("CohereForCausalLM", "CohereConfig", num_key_value_heads=2, use_qk_norm=True, logit_scale=0.5)
_qwen2_moe = _decoder("Qwen2MoeForCausalLM", "Qwen2MoeConfig", num_key_value_heads=2, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)
_gpt_oss = _decoder("GptOssForCausalLM", "GptOssConfig", num_key_value_heads=2, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, rope_parameters={
                        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 1})
# Experts sized from data: tokens per expert ``.tolist()`` then ``split`` (unbacked sizes ``u0``, checks on
# them): its graphs had gone through aten (JetMoE, 2026-11-29; ``test_data_dependent_sizes.py``)
_jetmoe = _decoder("JetMoeForCausalLM", "JetMoeConfig", num_local_experts=4, num_experts_per_tok=2, kv_channels=8,
                   num_key_value_heads=2)
# Gated DeltaNet layers (a causal convolution and the chunked delta rule, transformers' PyTorch
# reference of both) beside gated full attention, experts and a shared expert (Qwen3-Next)
_qwen3_next = _decoder("Qwen3NextForCausalLM", "Qwen3NextConfig", num_key_value_heads=2, head_dim=8, num_experts=4,
                       num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                       linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4,
                       layer_types=["linear_attention", "full_attention"])
_deepseek_v3 = _decoder("DeepseekV3ForCausalLM", "DeepseekV3Config", num_key_value_heads=4, n_routed_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=16, n_group=2, topk_group=1,
                        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8)


CASES = {
    "gpt2": Case(_gpt2, _causal_lm_inputs),
    "llama": Case(_llama, _causal_lm_inputs),
    "qwen2": Case(_qwen2, _causal_lm_inputs),
    "bert": Case(_bert, _masked_lm_inputs),
    "roformer": Case(_roformer, _masked_lm_inputs),
    "t5": Case(_t5, _seq2seq_inputs, seq2seq=True),
    "bart": Case(_bart, _seq2seq_inputs, seq2seq=True),
    "mixtral": Case(_mixtral, _causal_lm_inputs, graph_breaks=True),
    "mistral": Case(_mistral, _causal_lm_inputs),
    "phi3": Case(_phi3, _causal_lm_inputs),
    "qwen3": Case(_qwen3, _causal_lm_inputs),
    "gemma2": Case(_gemma2, _causal_lm_inputs),
    "gpt_neox": Case(_gpt_neox, _causal_lm_inputs),
    "bloom": Case(_bloom, _causal_lm_inputs),
    "falcon": Case(_falcon, _causal_lm_inputs),
    "deberta_v2": Case(_deberta_v2, _masked_lm_inputs),
    "cohere": Case(_cohere, _causal_lm_inputs),
    "qwen2_moe": Case(_qwen2_moe, _causal_lm_inputs),
    "jetmoe": Case(_jetmoe, _causal_lm_inputs),
    "gpt_oss": Case(_gpt_oss, _causal_lm_inputs),
    "deepseek_v3": Case(_deepseek_v3, _causal_lm_inputs),
    "whisper": Case(_whisper, _speech_inputs, seq2seq=True),
    "qwen3_next": Case(_qwen3_next, _causal_lm_inputs),
}


def build(name: str) -> torch.nn.Module:
    model = CASES[name].build()
    if model.loss_type is None:  # e.g. "GPT2LMHeadModel": transformers would warn (a graph break) and pick this
        model.loss_type = "ForCausalLM"
    return model


def tensors(value: Any, prefix: str = "out") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a model output, named: loss, logits, and each layer's cached keys and values."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, dict):  # ModelOutput is an OrderedDict of the fields that are set
        for key, item in value.items():
            yield from tensors(item, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensors(item, f"{prefix}[{i}]")
    elif hasattr(value, "self_attention_cache"):  # EncoderDecoderCache
        yield from tensors(value.self_attention_cache, f"{prefix}.self_attention")
        yield from tensors(value.cross_attention_cache, f"{prefix}.cross_attention")
    elif hasattr(value, "layers"):  # DynamicCache; a hybrid model's layers keep convolution and recurrent states
        for i, layer in enumerate(value.layers):
            if hasattr(layer, "keys"):
                yield from tensors((layer.keys, layer.values), f"{prefix}.layers[{i}]")
            if hasattr(layer, "conv_states"):  # a dict of tensors (None where unused) by state index
                yield from tensors({"conv": layer.conv_states, "recurrent": layer.recurrent_states},
                                   f"{prefix}.layers[{i}]")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, noise: float = 0.0) -> None:
    """Within float32 reassociation error, scaled with the tensor: an entry ~0 in eager is noise.

    ``noise`` is an absolute floor for tensors that are zero in exact arithmetic, where the tensor's
    own largest entry is itself rounding noise (e.g. the gradient of an attention key's bias: a
    softmax does not change when every logit of a row moves by the same q . b_k).
    """
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, (what, actual.shape, expected.shape)
    if not expected.is_floating_point():
        torch.testing.assert_close(actual, expected, atol=0, rtol=0, msg=what)
        return
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = max(1e-5 * scale, noise, 1e-30)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=atol,
                               msg=lambda m: f"{what} (max |eager| {scale:.3g}, atol {atol:.3g}): {m}")


def assert_outputs_close(out: Any, ref: Any, what: str) -> int:
    got, want = dict(tensors(out)), dict(tensors(ref))
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for name in want:
        assert_close(got[name], want[name], f"{what}: {name}")
    return len(want)


# torch 2.11's Dynamo (the GPU machine's) cannot trace all of transformers whole: T5's cache config
# is deep-copied (``copy.deepcopy`` is unsupported there) and BART branches on a tensor's value. On
# such a torch a model whose tracing Dynamo itself refuses is compiled with graph breaks instead;
# every graph still goes through our backend and the counters are still checked. CI's torch (2.13)
# compiles every model whole, and there a graph break fails the test.
WHOLE_GRAPH_REQUIRED = torch.__version__ >= (2, 13)


def compile_model(model: torch.nn.Module, options: dict[str, Any], fullgraph: bool = True) -> Callable[..., Any]:
    """The whole model in one Dynamo graph (``fullgraph``): every op goes through our backend."""
    return torch.compile(model, backend="cgtrees", fullgraph=fullgraph, options=options)


def first_call(model: torch.nn.Module, options: dict[str, Any], inputs: dict[str, torch.Tensor],
               graph_breaks: bool = False):
    """(compiled model, its first output, whether it was broken up): whole-graph, or (before torch
    2.13, where Dynamo refuses to trace the model whole) with Dynamo's graph breaks and a warning."""
    if graph_breaks:  # Dynamo breaks it up by design: every graph still goes through our backend
        compiled = compile_model(model, options, fullgraph=False)
        return compiled, compiled(**inputs), True
    compiled = compile_model(model, options)
    try:
        return compiled, compiled(**inputs), False
    except torch._dynamo.exc.Unsupported as e:
        if WHOLE_GRAPH_REQUIRED:
            raise
        warnings.warn(f"torch {torch.__version__}: Dynamo cannot trace the model whole, "
                      f"compiled with graph breaks: {str(e).splitlines()[0]}", stacklevel=2)
        torch._dynamo.reset()
        compiled = compile_model(model, options, fullgraph=False)
        return compiled, compiled(**inputs), True


def check_inference(name: str, options: dict[str, Any]) -> bool:
    """Two calls against eager; returns whether Dynamo broke the model up (torch < 2.13)."""
    case = CASES[name]
    model = build(name).eval()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for call in range(2):  # the second call on new values, after the first compiled
            inputs = case.inference_inputs()
            if call == 0:
                compiled, out, broken = first_call(model, options, inputs, case.graph_breaks)
            else:
                out = compiled(**inputs)
            assert_outputs_close(out, ref(**inputs), f"{name} inference call {call}")
    return broken


def check_training(name: str, options: dict[str, Any], steps: int = 2, lr: float = 0.1) -> bool:
    """Forward, loss, backward and an SGD step, ``steps`` times: outputs, loss and every gradient.

    SGD (not Adam) so a gradient difference reaches the next step's values in proportion, and a
    gradient that is noise around 0 is not blown up to a full step by normalisation. Returns whether
    Dynamo broke the model up (torch < 2.13).
    """
    case = CASES[name]
    model = build(name).train()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    compiled = None
    for step in range(steps):
        inputs = case.inputs()
        if compiled is None:
            compiled, out, broken = first_call(model, options, inputs, case.graph_breaks)
        else:
            out = compiled(**inputs)
        ref_out = ref(**inputs)
        assert_outputs_close(out, ref_out, f"{name} step {step}")
        out.loss.backward()
        ref_out.loss.backward()
        assert_grads_close(model, ref, f"{name} step {step}")
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    return broken


def assert_grads_close(model: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    """Every parameter's gradient, each within ``assert_close`` of eager's.

    A gradient that is zero in exact arithmetic (an attention key's bias: softmax ignores a shift
    shared by a whole row of logits) comes out of eager float32 as rounding noise, about one ulp of
    its module's weight gradient (measured: 0.4 to 1.6 ulp for BERT's and BART's key biases). So the
    noise floor of a parameter is 16 ulps (2**-19) of the largest gradient in its own module: for a
    tensor of its module's own scale that is 5x below the 1e-5 tolerance its values give it.
    """
    params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert params.keys() == ref_params.keys()
    module_scale: dict[str, float] = {}
    for pname, p in ref_params.items():
        if p.grad is not None:
            owner = pname.rpartition(".")[0]
            module_scale[owner] = max(module_scale.get(owner, 0.0), p.grad.abs().max().item())
    with_grad = 0
    for pname, p in params.items():
        want = ref_params[pname].grad
        assert (p.grad is None) == (want is None), f"{what}: gradient of {pname}: {p.grad} vs eager {want}"
        if want is not None:
            noise = module_scale[pname.rpartition(".")[0]] * 2.0**-19
            assert_close(p.grad, want, f"{what}: gradient of {pname}", noise)
            with_grad += 1
    assert with_grad > 0, f"{what}: no parameter has a gradient"
