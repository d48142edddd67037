"""The `llama` family: a decoder-only Transformer (Llama-style, Flax NNX), the base the other
families build on, and its Hugging Face format.

Modules: `layers` (norms, rotary embeddings, attention, MLP, the blocks and their scan),
`model` (the `LanguageModel` with its decode cache and size accounting), `hf` (LlamaForCausalLM and
Qwen3ForCausalLM; the tensor tables the other families' formats extend). Config: model.
"""

from kiln.model.llama.hf import (
    ATTENTION_TENSORS,
    FULL_ATTENTION,
    MLP_TENSORS,
    QK_NORM_TENSORS,
    LlamaHF,
    full_attention_only,
)
from kiln.model.llama.layers import (
    ACT_BSD,
    REMAT_POLICIES,
    TAGS,
    Attention,
    Block,
    Mlp,
    RMSNorm,
    rope_frequencies,
    stacked_blocks,
)
from kiln.model.llama.model import Transformer

__all__ = [
    "ACT_BSD",
    "ATTENTION_TENSORS",
    "FULL_ATTENTION",
    "MLP_TENSORS",
    "QK_NORM_TENSORS",
    "REMAT_POLICIES",
    "TAGS",
    "Attention",
    "Block",
    "LlamaHF",
    "Mlp",
    "RMSNorm",
    "Transformer",
    "full_attention_only",
    "rope_frequencies",
    "stacked_blocks",
]
