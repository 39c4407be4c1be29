"""Built-in causal language models: ``(B, T)`` token ids -> ``(B, T, vocab)`` next-token logits.

GPT-2, BERT and Llama come from transformers' model classes with random init; BERT runs as a decoder
(``is_decoder=True``) so each position only attends to earlier ones and it trains like GPT-2.
The Llama sizes run from a CPU test model (``llama_tiny``) to shapes only the memory planner builds,
on the meta device (``llama_7b``, ``llama_10b``, ``llama_70b``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainforge.data.spec import DataSpec
from trainforge.errors import ModelError
from trainforge.models.registry import MASKED_LM_MODELS, HFLogits, hf_config, register


def require_tokens(spec: DataSpec, name: str) -> tuple[int, int]:
    """Check that ``spec`` is token data and return ``(vocab_size, seq_len)``."""
    if spec.kind != "tokens":
        raise ModelError(
            f"built-in {name!r} is a language model but data.kind is {spec.kind!r}; "
            "pick an image model (mlp, small_cnn, resnet18, resnet50, resnet152, vit_b_16) or token data"
        )
    if spec.vocab_size is None or spec.vocab_size < 2:
        raise ModelError(f"built-in {name!r} needs token data with vocab_size >= 2, got {spec.vocab_size}")
    seq_len = spec.seq_len if spec.seq_len is not None else spec.input_shape[-1]
    return spec.vocab_size, seq_len


def check_positions(name: str, key: str, config: Any, seq_len: int) -> None:
    if getattr(config, key) < seq_len:
        raise ModelError(
            f"model.kwargs.{key}={getattr(config, key)} for {name!r} is shorter than data.seq_len={seq_len}; "
            f"raise {key} or shorten the sequences"
        )


def hf_gpt2(name: str, spec: DataSpec, arch: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab_size, seq_len = require_tokens(spec, name)
    defaults = {**arch, "n_positions": max(1024, seq_len), "bos_token_id": None, "eos_token_id": None}
    fixed = {"vocab_size": vocab_size, "attn_implementation": "sdpa"}
    config = hf_config(name, GPT2Config, defaults, fixed, overrides)
    check_positions(name, "n_positions", config, seq_len)
    # use_cache=False: a training forward has no use for the key/value cache it would otherwise build
    return HFLogits(GPT2LMHeadModel(config), use_cache=False)


@register("gpt2_small")
def gpt2_small(spec: DataSpec, **overrides: Any) -> nn.Module:
    """A 6-layer, 512-wide GPT-2; ``overrides`` are GPT2Config fields."""
    return hf_gpt2("gpt2_small", spec, {"n_layer": 6, "n_embd": 512, "n_head": 8}, overrides)


@register("gpt2_base")
def gpt2_base(spec: DataSpec, **overrides: Any) -> nn.Module:
    """The 124M GPT-2 (12 layers, 768 wide, 12 heads) on the data's vocabulary; ``overrides`` are GPT2Config fields."""
    return hf_gpt2("gpt2_base", spec, {"n_layer": 12, "n_embd": 768, "n_head": 12}, overrides)


def hf_bert(
    name: str, spec: DataSpec, arch: dict[str, Any], overrides: dict[str, Any], *, masked: bool = False
) -> nn.Module:
    """A BERT on the data's vocabulary: a causal LM (``is_decoder``), or with ``masked`` an encoder
    with BERT's masked-LM head over one more id, the mask token (models/tasks.MaskedLMTask)."""
    from transformers import BertConfig, BertForMaskedLM, BertLMHeadModel

    vocab_size, seq_len = require_tokens(spec, name)
    # pad_token_id=None: the data has no padding token, so every id gets a trainable embedding
    defaults = {**arch, "max_position_embeddings": max(512, seq_len), "pad_token_id": None}
    fixed = {"vocab_size": vocab_size + (1 if masked else 0), "is_decoder": not masked, "attn_implementation": "sdpa"}
    config = hf_config(name, BertConfig, defaults, fixed, overrides)
    check_positions(name, "max_position_embeddings", config, seq_len)
    if masked:
        return HFLogits(BertForMaskedLM(config))
    return HFLogits(BertLMHeadModel(config), use_cache=False)


BERT_SMALL = {"num_hidden_layers": 4, "hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 2048}
BERT_BASE = {"num_hidden_layers": 12, "hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 3072}


@register("bert_small")
def bert_small(spec: DataSpec, **overrides: Any) -> nn.Module:
    """A 4-layer, 512-wide BERT trained as a causal LM; ``overrides`` are BertConfig fields."""
    return hf_bert("bert_small", spec, BERT_SMALL, overrides)


@register("bert_base")
def bert_base(spec: DataSpec, **overrides: Any) -> nn.Module:
    """BERT-base (12 layers, 768 wide, 12 heads) trained as a causal LM; ``overrides`` are BertConfig fields."""
    return hf_bert("bert_base", spec, BERT_BASE, overrides)


@register("bert_small", MASKED_LM_MODELS)
def bert_small_masked(spec: DataSpec, **overrides: Any) -> nn.Module:
    """bert_small as BERT trains: an encoder with the masked-LM head (model.task masked_lm)."""
    return hf_bert("bert_small", spec, BERT_SMALL, overrides, masked=True)


@register("bert_base", MASKED_LM_MODELS)
def bert_base_masked(spec: DataSpec, **overrides: Any) -> nn.Module:
    """bert_base as BERT trains: an encoder with the masked-LM head (model.task masked_lm)."""
    return hf_bert("bert_base", spec, BERT_BASE, overrides, masked=True)


def hf_llama(name: str, spec: DataSpec, arch: dict[str, Any], overrides: dict[str, Any]) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab_size, seq_len = require_tokens(spec, name)
    # no bos/eos/pad ids: the data decides its own special tokens, and none of them is tied to the model
    defaults = {
        **arch,
        "max_position_embeddings": max(2048, seq_len),
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    fixed = {"vocab_size": vocab_size, "attn_implementation": "sdpa"}
    config = hf_config(name, LlamaConfig, defaults, fixed, overrides)
    check_positions(name, "max_position_embeddings", config, seq_len)
    return HFLogits(LlamaForCausalLM(config), use_cache=False)


def llama_arch(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    return {
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }


# Parameter counts below are at vocab 32000 (untied input and output embeddings); every size keeps
# grouped-query attention except llama_7b, which is Llama-2 7B as published.


@register("llama_tiny")
def llama_tiny(spec: DataSpec, **overrides: Any) -> nn.Module:
    """4 layers, 128 wide, 4 heads, 2 KV heads, MLP 384: 1.04M parameters at vocab 1000, for CPU tests."""
    return hf_llama("llama_tiny", spec, llama_arch(128, 384, 4, 4, 2), overrides)


@register("llama_10m")
def llama_10m(spec: DataSpec, **overrides: Any) -> nn.Module:
    """8 layers, 128 wide, 4 heads, 2 KV heads, MLP 512: 10.2M parameters (8.2M of them embeddings)."""
    return hf_llama("llama_10m", spec, llama_arch(128, 512, 8, 4, 2), overrides)


@register("llama_125m")
def llama_125m(spec: DataSpec, **overrides: Any) -> nn.Module:
    """12 layers, 768 wide, 12 heads, 4 KV heads, MLP 2048: 124.7M parameters, GPT-2-base sized."""
    return hf_llama("llama_125m", spec, llama_arch(768, 2048, 12, 12, 4), overrides)


@register("llama_1b")
def llama_1b(spec: DataSpec, **overrides: Any) -> nn.Module:
    """Llama-3.2-1B's shape (16 layers, 2048 wide, 32 heads, 8 KV heads, MLP 8192): 1.10B parameters."""
    return hf_llama("llama_1b", spec, llama_arch(2048, 8192, 16, 32, 8), overrides)


@register("llama_7b")
def llama_7b(spec: DataSpec, **overrides: Any) -> nn.Module:
    """Llama-2-7B's shape (32 layers, 4096 wide, 32 heads, 32 KV heads, MLP 11008): 6.74B parameters."""
    return hf_llama("llama_7b", spec, llama_arch(4096, 11008, 32, 32, 32), overrides)


@register("llama_10b")
def llama_10b(spec: DataSpec, **overrides: Any) -> nn.Module:
    """Llama-2-13B's width (5120, 40 heads, MLP 13824) with 8 KV heads and 36 layers: 10.24B parameters."""
    return hf_llama("llama_10b", spec, llama_arch(5120, 13824, 36, 40, 8), overrides)


@register("llama_70b")
def llama_70b(spec: DataSpec, **overrides: Any) -> nn.Module:
    """Llama-3-70B's shape (80 layers, 8192 wide, 64 heads, 8 KV heads, MLP 28672): 68.98B parameters
    at vocab 32000, 70.55B at Llama-3's 128256; for the planner on the meta device."""
    return hf_llama("llama_70b", spec, llama_arch(8192, 28672, 80, 64, 8), overrides)
