"""Language models behind one interface: the family registry, building and sizing.

`model.family` picks the implementation from `FAMILIES` (one line per family); every family
implements `LanguageModel`, so the trainer, the distillation objective, Hugging Face interop
and the size summary never name a concrete class.

Modules: `interface` (`LanguageModel`, `ModelOutput`, `KVCache`), the package `llama` (the
decoder-only Transformer, and Llama/Qwen3 on Hugging Face), the package `moe` (llama's blocks
with routed experts, and Qwen3-MoE/Mixtral), `gemma3` (llama's stack with Gemma 3's norms,
GeGLU and scales, and Gemma3ForCausalLM), `gpt_oss` (llama's attention with biases and sinks
over the `moe` family's experts with biases, and GptOssForCausalLM), the package `deepseek`
(DeepSeek-V3), the package `attention` (XLA, cuDNN and Pallas attention kernels behind one
call, and ring attention), `project` (projections with their gradient-reduction dtype),
`student` (the distillation student's extra parameters), `hf` (what every family's Hugging
Face format shares), `interop` (config.json and state dicts through each family's format). A
new family is one module or package here and one line in `FAMILIES` (its class and its
`HFFormat`), plus its line in `kiln.config.FAMILY_SECTIONS` (the config sections it reads).

May import: `kiln.errors`, `kiln.util`, `kiln.data`, `kiln.config`, `kiln.parallel`,
`kiln.losses` (the head's logits).

Public names: `FAMILIES`, `Family`, `LanguageModel`, `build_model`, `create_model`,
`flops_per_token`, `summary`, `expert_split`, `aux_metrics`, `predicts_ahead`, `state_size`,
`state_bytes_per_device`, `check_state_memory`, `DTYPES`, `KVCache`, `ModelOutput`; `interface.ROLES`, the roles a parameter declares
(`nnx.Param(..., role=...)`) for the optimizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from kiln.config import ModelConfig
from kiln.config.axes import entry_axes
from kiln.errors import KilnError
from kiln.model.deepseek import DeepseekHF, DeepseekTransformer
from kiln.model.gemma3 import Gemma3HF, Gemma3Transformer
from kiln.model.gpt_oss import GptOssHF, GptOssTransformer
from kiln.model.hf import HFFormat
from kiln.model.interface import DTYPES, KVCache, LanguageModel, ModelOutput, logits_dtype
from kiln.model.llama import LlamaHF, Transformer
from kiln.model.moe import MoeHF, MoeTransformer
from kiln.parallel.mesh import (
    device_memory,
    logical_spec,
    mesh_sizes_for_summary,
    sharded_init,
    shards_per_dim,
    state_specs,
)
from kiln.util.humanize import gigabytes, plural


class Family(NamedTuple):
    """What is a model family's own: the class that implements it (built as
    `model(model_cfg, rngs=...)`; its parameters declare their roles, its `init_cache` its
    cache layout) and its Hugging Face format. The config sections it reads are its line in
    `kiln.config.FAMILY_SECTIONS`."""

    model: type[LanguageModel]
    hf: HFFormat


# model.family -> its entry (one line per family).
FAMILIES: dict[str, Family] = {
    "llama": Family(Transformer, LlamaHF()),
    "moe": Family(MoeTransformer, MoeHF()),
    "deepseek": Family(DeepseekTransformer, DeepseekHF()),
    "gemma3": Family(Gemma3Transformer, Gemma3HF()),
    "gpt_oss": Family(GptOssTransformer, GptOssHF()),
}


def build_model(model_cfg: ModelConfig, *, rngs: nnx.Rngs) -> LanguageModel:
    """The configured family's model, initialised eagerly from `rngs` (unsharded)."""
    return FAMILIES[model_cfg.family].model(model_cfg, rngs=rngs)


def create_model(config: Any, mesh, seed: int) -> LanguageModel:
    """The model of `config.model` with parameters created already sharded on `mesh` (or None)."""
    return sharded_init(
        lambda: build_model(config.model, rngs=nnx.Rngs(seed)), mesh, config.mesh.rules
    )


def abstract_model(model_cfg: ModelConfig) -> LanguageModel:
    """The model with ShapeDtypeStructs for arrays (`nnx.eval_shape`): allocates nothing."""
    return nnx.eval_shape(lambda: build_model(model_cfg, rngs=nnx.Rngs(0)))


def abstract_state(model_cfg: ModelConfig) -> nnx.State:
    """Parameter shapes and dtypes (ShapeDtypeStructs) of the model, allocating nothing."""
    return nnx.state(abstract_model(model_cfg), nnx.Param)


def aux_metrics(model_cfg: ModelConfig, sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The configured family's scalars from a step's global aux sums (`ModelOutput.aux`)."""
    return FAMILIES[model_cfg.family].model.aux_metrics(model_cfg, sums)


def predicts_ahead(model_cfg: ModelConfig) -> tuple[int, float]:
    """(multi-token prediction modules, their loss weight) of the configured family."""
    return FAMILIES[model_cfg.family].model.predicts_ahead(model_cfg)


def flops_per_token(model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the configured family (`LanguageModel.flops_per_token`)."""
    return abstract_model(model_cfg).flops_per_token(seq_len)


def state_size(config: Any, sizes: dict[str, int]) -> tuple[int, int, int]:
    """(parameters, parameters per device, bytes per parameter) of `config.model` on a mesh
    of `sizes`, from shapes only."""
    m = config.model
    state = abstract_state(m)
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    per_device = sum(n for n, _ in _shards(state, config, sizes))
    return total, per_device, jnp.dtype(DTYPES[m.param_dtype]).itemsize


def _shards(state: Any, config: Any, sizes: dict[str, int], derived: bool = False):
    """(elements, bytes per element) one device holds of each array of `state` (shapes), as
    `state_specs` shards it on a mesh of `sizes`."""
    specs = state_specs(state, config.mesh.rules, sizes, derived=derived)
    spec_leaves = jax.tree.leaves(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    for x, spec in zip(jax.tree.leaves(state), spec_leaves, strict=True):
        pieces = (*shards_per_dim(spec, sizes), *(1,) * len(x.shape))  # P(): every dim whole
        elements = math.prod(math.ceil(n / p) for n, p in zip(x.shape, pieces))
        yield elements, jnp.dtype(x.dtype).itemsize


# An optimizer as the summary and the memory check see it: `init(params) -> state` (traced
# with shapes only) and the name of the state it keeps ("AdamW moments"). The optimizers live
# in `kiln.training.optim` (`OPTIMIZERS`); this layer never names one.
OptimizerInit = Callable[[Any], Any]


def summary(
    config: Any, init: OptimizerInit, state_name: str, num_devices: int | None = None
) -> str:
    """Parameters, FLOPs per token and per-device state memory for the configured mesh:
    parameters, gradients and the optimizer state `init` makes (named `state_name`).

    A mesh size of -1 takes the rest of `num_devices` (default: the local devices).
    """
    m = config.model
    sizes = mesh_sizes_for_summary(config, num_devices)
    total, per_device, itemsize = state_size(config, sizes)
    model = abstract_model(m)
    embed = m.vocab_size * m.d_model
    flops = model.flops_per_token(config.data.seq_len)
    # Decimal GB, as the compiled figures and --hbm-gb are.
    gb = per_device * itemsize / 1e9
    opt_gb = optimizer_state_bytes(config, init, sizes) / 1e9
    mesh_text = " x ".join(f"{a}={s}" for a, s in sizes.items())
    inactive = model.inactive_params()
    beside = model.auxiliary_params()
    main = total - beside  # the decoder generate runs
    cache_bytes, cache_what = model.cache_bytes_per_token()
    active = [
        f"active per token:  {main - inactive:,} ({(main - inactive) / 1e9:.3f}B; all but the "
        f"{inactive:,} of the routed experts beyond each token's top-k)"
    ]
    modules = [
        f"mtp modules:       {beside:,} more ({beside / 1e9:.3f}B; multi-token prediction, "
        "trained and saved with the model, not run by kiln generate)"
    ]
    return "\n".join(
        [
            f"parameters:        {main:,} ({main / 1e9:.3f}B; embedding {embed:,}, "
            f"LM head {'tied' if m.tie_embeddings else f'{embed:,}'}, "
            f"non-embedding {main - embed * (1 if m.tie_embeddings else 2):,})",
            *(modules if beside else []),
            *(active if inactive else []),
            f"FLOPs per token:   {flops:.4g} (training, seq_len {config.data.seq_len}; "
            f"6 x {model.matmul_params():,} {'active ' if inactive else ''}matmul params + "
            f"causal attention{_window_text(m)})",
            f"decode cache:      {cache_bytes:,} bytes per token (kiln generate: {cache_what})",
            f"mesh:              {mesh_text} ({plural(math.prod(sizes.values()), 'device')})",
            *_expert_lines(config, sizes),
            f"memory per device: {per_device:,} parameters x {itemsize} bytes ({m.param_dtype})",
            f"  params {gb:.2f} GB + grads {gb:.2f} GB + "
            f"{state_name} {opt_gb:.2f} GB "
            f"= {2 * gb + opt_gb:.2f} GB (state, before activations)",
        ]
    )


def _window_text(m: Any) -> str:
    """`summary`'s words on the sliding_attention layers, whose queries see their window only."""
    local = sum(m.local_layers())
    if not local:
        return ""
    full, window = m.num_layers - local, m.sliding_window
    return f" over all earlier keys in {full} layers and the last {window} in {local}"


def _expert_lines(config: Any, sizes: dict[str, int]) -> list[str]:
    """`summary`'s line on how the mesh splits the routed experts (none for a dense model)."""
    split = expert_split(config, sizes)
    if split is None:
        return []
    count, axes, pieces = split
    if pieces > 1:
        where = f"split over mesh.{axes[0]}={pieces}: {count // pieces} per device"
    else:
        where = "every device runs all of them (" + (
            f"mesh.{axes[0]}=1)" if axes else "mesh.rules.experts: [])"
        )
    return [f"routed experts:    {count} per MoE layer; {where}"]


def expert_split(config: Any, sizes: dict[str, int]) -> tuple[int, tuple[str, ...], int] | None:
    """(experts per layer, the mesh axes that split them, into how many pieces) on a mesh of
    `sizes`, from the parameters with an `experts` dimension; None when no parameter has one."""
    state = abstract_state(config.model)
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = tuple(var.get_metadata().get("out_sharding") or ())
        if "experts" in names:
            dim = names.index("experts")
            spec = logical_spec(names, config.mesh.rules)
            axes = entry_axes(spec[dim])
            return var.get_value().shape[dim], axes, shards_per_dim(spec, sizes)[dim]
    return None


def state_bytes_per_device(state: Any, config: Any, sizes: dict[str, int]) -> int:
    """Bytes one device holds of an optimizer's state (ShapeDtypeStructs), as it is sharded."""
    return sum(n * itemsize for n, itemsize in _shards(state, config, sizes, derived=True))


def optimizer_state_bytes(config: Any, init: OptimizerInit, sizes: dict[str, int]) -> int:
    """Bytes one device holds of the optimizer state `init` makes for `config.model` on a mesh
    of `sizes`."""
    state = jax.eval_shape(init, abstract_state(config.model))
    return state_bytes_per_device(state, config, sizes)


def check_state_memory(config: Any, mesh, init: OptimizerInit, state_name: str) -> None:
    """KilnError, before any parameter is allocated, when the train state (`summary`'s
    parameters, gradients and optimizer state) cannot fit in the memory of this process's
    devices of `mesh`."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    memory = device_memory(local)
    if memory is None:
        return
    available, what = memory
    sizes = dict(mesh.shape)
    total, per_device, itemsize = state_size(config, sizes)
    per_device_bytes = 2 * per_device * itemsize + optimizer_state_bytes(config, init, sizes)
    needed = per_device_bytes * len(local)
    if needed > available:
        m = config.model
        raise KilnError(
            f"model: the train state of {total:,} parameters (d_model={m.d_model}, "
            f"num_layers={m.num_layers}, vocab_size={m.vocab_size}, {m.param_dtype}) needs "
            f"{gigabytes(needed)} for parameters, gradients and "
            f"{state_name}, more than the "
            f"{gigabytes(available)} of {what}; shrink the model or add devices (`kiln config "
            "CONFIG --summary` shows the state per device)"
        )


__all__ = [
    "DTYPES",
    "FAMILIES",
    "Family",
    "KVCache",
    "LanguageModel",
    "ModelOutput",
    "abstract_model",
    "abstract_state",
    "aux_metrics",
    "build_model",
    "check_state_memory",
    "create_model",
    "expert_split",
    "flops_per_token",
    "logits_dtype",
    "optimizer_state_bytes",
    "predicts_ahead",
    "state_bytes_per_device",
    "state_size",
    "summary",
]
