"""AdamW with global-norm clipping, and the learning-rate schedules."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from kiln.config import OptimConfig

Schedule = Callable[[jax.Array], jax.Array]

# Parameters whose path contains one of these names are not weight-decayed (norm scales, biases).
NO_DECAY_NAMES = ("norm", "scale", "bias")


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


def decay_mask(params) -> object:
    """True for parameters that get weight decay: everything but norm scales and biases."""

    def keep(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
        return not any(n in name for name in names for n in NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clipping and AdamW without the learning rate: the train step scales by the schedule.

    Keeping the learning rate outside optax makes it an exact function of the train step, which
    is what `learning/current_learning_rate` reports and what a resumed run continues from.
    """
    parts = []
    if cfg.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay:
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
