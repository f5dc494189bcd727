"""Small Hugging Face models built from ``transformers`` configs, as ``compare --model`` factories.

``--model lowprec.compare.zoo:llama`` trains a Llama-style causal LM and ``--model lowprec.compare.zoo:moe`` a
Mixtral-style mixture of experts, so that formats and precision plans can be tried on the architectures people
train, not only on the demo GPT. Both are drawn at random from the seed compare sets (nothing is downloaded) and
learn the demo's corpus (Python's help topics as bytes, ``lowprec.demo.corpus``), on which the loss visibly falls
within a few dozen steps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lowprec.demo import corpus

VOCAB = 256  # bytes
SEQ, BATCH = 64, 8
#: the shapes both models share: 2 layers of hidden size 64, 4 attention heads over 2 key-value heads
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": SEQ,
}
#: Mixtral's experts per layer and the experts each token is routed to
EXPERTS, TOP_K = 4, 2


class CausalLM(torch.nn.Module):
    """A Hugging Face causal LM whose ``forward(tokens)`` returns the next-token loss, as compare's models must."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, labels=tokens).loss


def corpus_batches(batch: int = BATCH, seq: int = SEQ) -> Callable[[int], torch.Tensor]:
    """``batch_fn(step)``: ``batch`` windows of ``seq`` bytes of the corpus at offsets drawn from torch's global
    generator, which compare seeds before each batch, so that every recipe reads the same ones."""
    text = corpus()

    def batch_fn(step: int) -> torch.Tensor:
        starts = torch.randint(0, len(text) - seq, (batch,)).tolist()
        return torch.stack([text[s : s + seq] for s in starts])

    return batch_fn


def llama() -> tuple[torch.nn.Module, Callable[[int], Any]]:
    """A 2-layer Llama (``LlamaForCausalLM``, hidden 64, MLP 128, untied head) and its corpus batches. ``convert``
    makes 15 layers of it: per layer q, k, v, o, gate, up and down projections, and ``lm_head``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return CausalLM(LlamaForCausalLM(LlamaConfig(intermediate_size=128, **COMMON))), corpus_batches()


def moe() -> tuple[torch.nn.Module, Callable[[int], Any]]:
    """A 2-layer Mixtral (``MixtralForCausalLM``, 4 experts of MLP size 64, top-2) and its corpus batches. ``convert``
    makes per layer q, k, v and o projections, the router and the experts (whose GEMMs are the debug layers
    ``...experts.gate_up_proj.gemm_{i}`` and ``...experts.down_proj.gemm_{i}``), and ``lm_head``: 27 GEMM layers."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(intermediate_size=64, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, **COMMON)
    return CausalLM(MixtralForCausalLM(config)), corpus_batches()
