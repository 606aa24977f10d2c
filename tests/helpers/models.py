"""Tiny models that the multi-rank tests shard: a GPT and a Qwen small enough for gloo ranks on CPUs."""

from torch import nn

from taco.models import GPT, GPTConfig, Qwen, QwenConfig


def tiny_gpt():
    return GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=16))


def tiny_qwen(qk_norm=False):
    return Qwen(
        QwenConfig(
            vocab_size=64,
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=16,
            tie_word_embeddings=False,
            qk_norm=qk_norm,
            attention_bias=not qk_norm,
        )
    )


VOCAB, SEQ = 64, 8


def tiny_model(kind: str, n_layer: int = 3) -> nn.Module:
    """Kinds: "gpt", "qwen" (2 KV heads: tp <= 2) or "qwen-kv4" (4 KV heads: tp up to 4)."""
    if kind == "gpt":  # tied embeddings
        return GPT(GPTConfig(vocab_size=VOCAB, n_layer=n_layer, n_head=4, n_embd=32, block_size=SEQ))
    return Qwen(  # untied lm_head
        QwenConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=n_layer,
            num_attention_heads=4,
            num_key_value_heads=4 if kind == "qwen-kv4" else 2,
            max_position_embeddings=SEQ,
        )
    )
