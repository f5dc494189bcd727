"""The tiny Hugging Face model the integration, LoRA and checkpointing tests train: hidden 64, 2 layers."""

from __future__ import annotations

from typing import Any


def tiny_llama_config(**overrides: Any) -> Any:
    """A ``transformers.LlamaConfig`` of a model that trains in a second on a CPU core; ``overrides`` change fields."""
    from transformers import LlamaConfig

    fields = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
    }
    return LlamaConfig(**(fields | overrides))
