"""The optimizers (AdamW, Muon, Adafactor, Lion), gradient clipping, weight decay by parameter
role, and the learning-rate schedules.

Which rule a parameter gets (weight decay; Muon or AdamW) is decided by the role its model
declares on it (`kiln.model.interface.ROLES`), never by its name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers, scale_by_muon

from kiln.config import OptimConfig
from kiln.errors import KilnError
from kiln.model.interface import ROLES

Schedule = Callable[[jax.Array], jax.Array]

# Roles that get weight decay; the embedding's follows `optim.decay_embeddings`.
DECAYED_ROLES = ("matrix", "head", "projection", "router")
# Batch axes of a matrix parameter, never its input or output: the stacked-layers axis of
# scanned blocks (one matrix per layer) and the experts of an MoE layer (one per expert).
BATCH_AXES = ("layers", "unstaged_layers", "experts")


def make_schedule(cfg: OptimConfig, total_steps: int) -> Schedule:
    """Learning rate at a (0-based) step: linear warmup from 0, then the configured shape.

    constant: lr.  cosine: lr * (f + (1 - f) (1 + cos(pi p)) / 2).  linear: lr * (1 - (1 - f) p),
    with p the fraction of the post-warmup steps done and f = final_lr_fraction.  wsd: lr until
    the last `decay_fraction * steps` steps, then linear or cosine down to f * lr.
    """
    lr, warmup, f = cfg.learning_rate, cfg.warmup_steps, cfg.final_lr_fraction
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    decay_start = max(warmup, total_steps - decay_steps)

    def shape(p: jax.Array) -> jax.Array:
        p = jnp.clip(p, 0.0, 1.0)
        if cfg.schedule == "constant":
            return jnp.ones_like(p)
        if cfg.schedule == "linear" or (cfg.schedule == "wsd" and cfg.decay_shape == "linear"):
            return 1.0 - (1.0 - f) * p
        return f + (1.0 - f) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))

    def schedule(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = (step + 1.0) / warmup if warmup else jnp.float32(1.0)
        if cfg.schedule == "wsd":
            p = (step - decay_start) / max(1, total_steps - decay_start)
        else:
            p = (step - warmup) / max(1, total_steps - warmup)
        return lr * jnp.where(step < warmup, warm, shape(p))

    return schedule


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def role_of(var: nnx.Variable) -> str:
    """The role a parameter declares; a KilnError if it declares none or an unknown one."""
    role = var.get_metadata().get("role")
    if role not in ROLES:
        raise KilnError(
            f"a parameter of shape {tuple(var.get_value().shape)} declares role {role!r}; "
            f"allowed: {', '.join(ROLES)} (the model sets nnx.Param(..., role=...))"
        )
    return role


def _per_parameter(decide: Callable[[nnx.Variable], Any], tree: Any) -> Any:
    """`decide(var)` for every parameter of an nnx State, in the State's own structure."""
    return jax.tree.map(lambda v: v.replace(decide(v)), tree, is_leaf=_is_variable)


def decay_mask(params: Any, cfg: OptimConfig, roles: tuple[str, ...] | None = None) -> Any:
    """True for the parameters that get weight decay, by their declared role: hidden matrices,
    the LM head, the distillation projection, and the embedding if `optim.decay_embeddings`;
    only those of `roles` when given."""
    decayed = (*DECAYED_ROLES, "embedding") if cfg.decay_embeddings else DECAYED_ROLES
    if roles is not None:
        decayed = tuple(r for r in decayed if r in roles)
    return _per_parameter(lambda v: role_of(v) in decayed, params)


def muon_dimensions(var: nnx.Variable) -> MuonDimensionNumbers:
    """The axes a matrix contracts with its input (its declared `fan_in`) and its output axes;
    the stacked `layers` axis and an MoE layer's `experts` axis are batch axes."""
    names = tuple(var.get_metadata().get("out_sharding") or ())
    fan_in = tuple(var.get_metadata().get("fan_in") or ())
    if len(names) != var.get_value().ndim or not fan_in or not set(fan_in) <= set(names):
        raise KilnError(
            f"a matrix parameter with axes {names} declares fan_in {fan_in}; "
            "allowed: a non-empty subset of its axes' logical names"
        )
    into = tuple(i for i, n in enumerate(names) if n in fan_in)
    out = tuple(i for i, n in enumerate(names) if n not in fan_in and n not in BATCH_AXES)
    return MuonDimensionNumbers(reduction_axis=into, output_axis=out)


def muon_labels(params: Any) -> Any:
    """'muon' for hidden matrices, 'adamw' for every other parameter."""
    return jax.tree.map(
        lambda v: "muon" if role_of(v) == "matrix" else "adamw", params, is_leaf=_is_variable
    )


def _muon_dimension_tree(updates: Any) -> Any:
    """Dimension numbers per matrix of the (partition-masked) updates Muon sees."""
    return _per_parameter(muon_dimensions, updates)


def match_adamw_rms(rms_scale: float) -> optax.GradientTransformation:
    """Each orthogonalised update times rms_scale * sqrt(max(fan_in, fan_out)): Muon's updates
    then have AdamW's typical RMS (Moonlight: 0.2), so AdamW's learning rate carries over."""

    def scaled(var: nnx.Variable) -> jax.Array:
        dims, shape = muon_dimensions(var), var.get_value().shape
        fan_in = math.prod(shape[i] for i in dims.reduction_axis)
        fan_out = math.prod(shape[i] for i in dims.output_axis)
        return var.get_value() * (rms_scale * math.sqrt(max(fan_in, fan_out)))

    return optax.stateless(lambda updates, params=None: _per_parameter(scaled, updates))


def _adamw(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def _muon(cfg: OptimConfig) -> optax.GradientTransformation:
    m = cfg.muon
    matrices = optax.chain(
        scale_by_muon(
            ns_steps=m.ns_steps,
            beta=m.beta,
            nesterov=m.nesterov,
            weight_dimension_numbers=_muon_dimension_tree,
        ),
        match_adamw_rms(m.rms_scale),
    )
    return optax.partition({"muon": matrices, "adamw": _adamw(cfg)}, muon_labels)


def _adafactor(cfg: OptimConfig) -> optax.GradientTransformation:
    a = cfg.adafactor
    parts = [
        optax.scale_by_factored_rms(
            factored=a.factored,
            decay_rate=a.decay_rate,
            min_dim_size_to_factor=a.min_dim_size_to_factor,
            epsilon=a.eps,
        )
    ]
    if a.clipping_threshold is not None:
        parts.append(optax.clip_by_block_rms(a.clipping_threshold))
    return optax.chain(*parts)


def _lion(cfg: OptimConfig) -> optax.GradientTransformation:
    return optax.scale_by_lion(b1=cfg.lion.b1, b2=cfg.lion.b2)


class Optimizer(NamedTuple):
    """An `optim.name`: its update direction (before weight decay and learning rate) and how
    `kiln config --summary` names the state it keeps."""

    direction: Callable[[OptimConfig], optax.GradientTransformation]
    state: str


# optim.name -> its optimizer (one line per optimizer; the schema's `optim.name` lists these).
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(_adamw, "AdamW moments"),
    "muon": Optimizer(_muon, "Muon momentum + AdamW moments"),
    "adafactor": Optimizer(_adafactor, "Adafactor statistics"),
    "lion": Optimizer(_lion, "Lion momentum"),
}


def state_name(cfg: OptimConfig) -> str:
    """How the summary and the memory check name the configured optimizer's state."""
    return OPTIMIZERS[cfg.name].state


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clipping, the optimizer's direction and decoupled weight decay, without the learning
    rate: the train step scales by the schedule.

    Keeping the learning rate outside optax makes it an exact function of the train step, which
    is what `learning/current_learning_rate` reports and what a resumed run continues from.
    The parameters are an nnx State whose Params declare their roles (the masks read them).
    """
    parts = []
    if cfg.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(OPTIMIZERS[cfg.name].direction(cfg))
    for rate, roles in _weight_decays(cfg):
        parts.append(optax.add_decayed_weights(rate, mask=lambda p, r=roles: decay_mask(p, cfg, r)))
    return optax.chain(*parts)


def _weight_decays(cfg: OptimConfig) -> list[tuple[float, tuple[str, ...] | None]]:
    """(rate, roles) of each decoupled weight decay, rates of 0 left out: `optim.weight_decay`
    for every decayed role (roles None), or, with Muon's matrices at their own
    `optim.muon.weight_decay`, that for the matrices and `optim.weight_decay` for the rest."""
    own = cfg.muon.weight_decay if cfg.name == "muon" else None
    if own is None or own == cfg.weight_decay:
        groups = [(cfg.weight_decay, None)]
    else:
        rest = tuple(r for r in (*DECAYED_ROLES, "embedding") if r != "matrix")
        groups = [(own, ("matrix",)), (cfg.weight_decay, rest)]
    return [(rate, roles) for rate, roles in groups if rate]
