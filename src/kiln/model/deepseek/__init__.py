"""The `deepseek` family: DeepSeek-V3's multi-head latent attention, routed experts (the `moe`
family's, routed as model.moe says) and multi-token prediction, with its Hugging Face format.

Modules: `mla` (latent attention and YaRN), `model` (blocks, the prediction modules, the
`LanguageModel`), `hf` (DeepseekV3ForCausalLM). Config: model.moe and model.deepseek.
"""

from kiln.model.deepseek.hf import DeepseekHF
from kiln.model.deepseek.model import DeepseekTransformer

__all__ = ["DeepseekHF", "DeepseekTransformer"]
