"""The objective seam: what a step optimises, as weighted sums over tokens.

An `Objective` calls the model on a micro-batch and returns sums that add across
micro-batches; `kiln.training.train` accumulates them and their gradients and divides once by
the global token weight. Pre-training (`LMObjective`) and distillation
(`kiln.distill.online.DistillObjective`) are two; the model's own loss terms and statistics
(`ModelOutput.aux`) join every objective here, not in each.
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from kiln import losses
from kiln.config import Config
from kiln.model import ModelOutput, aux_metrics, flops_per_token, predicts_ahead
from kiln.training.batches import Batch

Sums = dict[str, jax.Array]


class Objective(struct.PyTreeNode):
    """What a step optimises, as weighted sums over tokens that add across micro-batches.

    The objective calls the model (`loss_sums`) and adds the model's own terms (`ModelOutput.aux`:
    an MoE router's losses and statistics) to what a subclass computes, so that no subclass
    mentions them. A subclass names its sums (`sum_keys`, always with `weight_sum`, the token
    weight) and implements two methods:

    - `sums(model, out, batch, coefficients) -> (value, sums)`: from the model's output `out`
      (`ModelOutput`) on one micro-batch, float32 scalar sums and a scalar `value` whose
      gradient, summed over the micro-batches and divided once by the global `weight_sum`, is
      the gradient of `result(global sums)[0]`;
    - `result(sums) -> (loss, metrics)`: the loss and its diagnostics from the global sums
      (keys containing "/" are logged as metrics under that tag).

    A model with multi-token prediction modules (`ModelOutput.ahead`) gets their LM losses
    here too, each through the same loss engine on the targets d tokens further ahead, as a
    mean per token of its own weights (`learning/mtp_loss`, the mean over the modules), added
    to the loss times the family's weight (`kiln.model.predicts_ahead`).

    The model's aux scalars are sums over the tokens it ran (segment id > 0, counted in
    `token_sum`), so they are divided by those tokens, not by the loss weights: a batch whose
    prompts weigh 0 keeps its router losses at their scale. An objective whose value weights
    its sums by coefficients that depend on the *global* sums (dynamic balancing) sets
    `needs_global_sums` and implements `coefficients(sums)`: with several micro-batches a
    forward pass computes the global sums first; with one, `sums` gets None and derives them
    from its own sums. Arrays an objective holds (e.g. a teacher's parameters) are pytree
    fields, passed to the jitted step as arguments; settings are static fields.
    """

    sum_keys: ClassVar[tuple[str, ...]] = ("weight_sum",)
    needs_global_sums: ClassVar[bool] = False
    # Top-level parameter collections the objective adds to the model (fresh on load_params_from).
    extra_param_keys: ClassVar[tuple[str, ...]] = ()

    config: Config = struct.field(pytree_node=False)
    mesh: Mesh | None = struct.field(pytree_node=False)

    def for_step(self, step: jax.Array) -> Objective:
        """This objective at a (traced) train step, for settings on a schedule."""
        return self

    def collect(self) -> tuple[int, ...]:
        """The blocks (0-based) whose residual stream `sums` reads as `out.features`."""
        return ()

    def sums(
        self, model, out: ModelOutput, batch: Batch, coefficients: Any
    ) -> tuple[jax.Array, Sums]:
        raise NotImplementedError

    def result(self, sums: Sums) -> tuple[jax.Array, dict[str, jax.Array]]:
        raise NotImplementedError

    def coefficients(self, sums: Sums) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not use global coefficients")

    def loss_sums(
        self, model, batch: Batch, coefficients: Any = None, totals: Sums | None = None
    ) -> tuple[jax.Array, Sums]:
        """(value, sums) of one micro-batch: the subclass's, with the model's aux sums and
        `token_sum` added, and the model's loss terms in the value. `totals` (`batch_totals`
        of the global batch; None: of `batch`) scale those terms so that the one division by
        the global weight leaves them per token the model ran."""
        out = model.hidden_states(
            batch["inputs"], batch["positions"], batch["segment_ids"], collect=self.collect()
        )
        value, sums = self.sums(model, out, batch, coefficients)
        own = batch_totals(batch, len(out.ahead))
        totals = own if totals is None else totals
        sums = {**sums, **out.aux, "token_sum": own["token_sum"]}
        for k in aux_loss_keys(out.aux):
            value = value + out.aux[k] * _per_model_token(totals)
        if out.ahead:
            _, weight = predicts_ahead(self.config.model)
            head_DV = model.head_weight()
            for d, hidden_BSD in enumerate(out.ahead, 1):
                targets, weights = losses.ahead_targets(
                    batch["targets"], batch["weights"], batch["segment_ids"], d
                )
                ahead_batch = {"targets": targets, "weights": weights}
                lm = lm_loss_sums(self.config, hidden_BSD, head_DV, ahead_batch, self.mesh)
                sums[f"ahead_{d}_loss_sum"] = lm["loss_sum"]
                sums[f"ahead_{d}_weight_sum"] = lm["weight_sum"]
                per_weight = _ratio(totals["weight_sum"], totals[f"ahead_{d}_weight_sum"])
                value = value + weight / len(out.ahead) * lm["loss_sum"] * per_weight
        return value, sums

    def finalize(self, sums: Sums) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(loss, aux) of the global sums: the subclass's result plus the model's loss terms
        per token it ran, and its aux scalars and statistics (`aux_results`)."""
        loss, metrics = self.result(sums)
        model = aux_results(self.config, sums)
        for k in aux_loss_keys(sums):
            loss = loss + model[k]
        depth, weight = predicts_ahead(self.config.model)
        if depth:
            mtp = (
                sum(
                    _ratio(sums[f"ahead_{d}_loss_sum"], sums[f"ahead_{d}_weight_sum"])
                    for d in range(1, depth + 1)
                )
                / depth
            )
            loss = loss + weight * mtp
            model["learning/mtp_loss"] = mtp
        return loss, {**metrics, **model}

    def pinned_inputs(self) -> dict[str, Any]:
        """Inputs beyond the data that a resumed run must keep (recorded in inputs.json)."""
        return {}

    def flops_per_token(self) -> float:
        """Training FLOPs per token of one step, for perf/mfu."""
        return flops_per_token(self.config.model, self.config.data.seq_len)


def batch_totals(batch: Batch, ahead: int = 0) -> Sums:
    """float32 `weight_sum` (the loss weights) and `token_sum` (tokens with segment id > 0,
    those a model's aux sums are over) of a batch; with `ahead`, each multi-token prediction
    module's weight `ahead_{d}_weight_sum` (`kiln.losses.ahead_targets`), d = 1..ahead."""
    out = {
        "weight_sum": jnp.sum(batch["weights"].astype(jnp.float32)),
        "token_sum": jnp.sum((batch["segment_ids"] > 0).astype(jnp.float32)),
    }
    for d in range(1, ahead + 1):
        _, weights = losses.ahead_targets(
            batch["targets"], batch["weights"], batch["segment_ids"], d
        )
        out[f"ahead_{d}_weight_sum"] = jnp.sum(weights.astype(jnp.float32))
    return out


def _ratio(total: jax.Array, weight: jax.Array) -> jax.Array:
    """total / weight, 0 for a weight of 0 (and the gradient finite)."""
    return total / jnp.where(weight > 0, weight, 1.0)


def _per_model_token(totals: Sums) -> jax.Array:
    """The factor that turns a sum over model tokens, once divided by the weight as every
    gradient is (`token_mean`), into a sum per model token: weight / tokens (0 without tokens)."""
    weight, tokens = totals["weight_sum"], totals["token_sum"]
    weight = jnp.where(weight > 0, weight, 1.0)
    return jnp.where(tokens > 0, weight / jnp.where(tokens > 0, tokens, 1.0), 0.0)


def token_mean(total: jax.Array, sums: Sums) -> jax.Array:
    """A sum divided by the token weight `sums["weight_sum"]` (0 for a batch of only padding)."""
    return _ratio(total, sums["weight_sum"])


def model_token_mean(total: jax.Array, sums: Sums) -> jax.Array:
    """A sum of the model's aux divided by the tokens it ran, `sums["token_sum"]`."""
    return _ratio(total, sums["token_sum"])


def aux_loss_keys(sums: Sums) -> list[str]:
    """The model's loss terms among the sums: `ModelOutput.aux` scalars whose tag ends in `_loss`."""
    return [k for k, v in sums.items() if "/" in k and k.endswith("_loss") and jnp.ndim(v) == 0]


def aux_results(config: Config, sums: Sums) -> dict[str, jax.Array]:
    """What `finalize` reports of the model's aux sums (`ModelOutput.aux`): each scalar per
    token the model ran under its tag, the family's `aux_metrics` of the arrays, and the
    arrays themselves (global sums, for `update_balance`)."""
    model_sums = {k: v for k, v in sums.items() if "/" in k}
    scalars = {k: model_token_mean(v, sums) for k, v in model_sums.items() if jnp.ndim(v) == 0}
    arrays = {k: v for k, v in model_sums.items() if jnp.ndim(v) > 0}
    return {**scalars, **(aux_metrics(config.model, arrays) if arrays else {}), **arrays}


def lm_loss_sums(config: Config, hidden_BSD, head_DV, batch: Batch, mesh) -> Sums:
    """LM loss sums (loss_sum, z_loss_sum, weight_sum) of final hidden states, as configured."""
    return losses.lm_loss(
        hidden_BSD,
        head_DV,
        batch["targets"],
        batch["weights"],
        z_loss_multiplier=config.loss.z_loss_multiplier,
        label_smoothing=config.loss.label_smoothing,
        logit_softcap=config.model.logit_softcap,
        num_vocab_tiling=config.loss.num_vocab_tiling,
        mesh=mesh,
        rules=config.mesh.rules,
        vocab_chunk_size=config.loss.vocab_chunk_size,
        schedule=config.loss.schedule,
    )


class LMObjective(Objective):
    """Pre-training: the language-model loss (cross-entropy with z-loss) per token; the model's
    own loss terms (an MoE router's) join it in `Objective`."""

    sum_keys: ClassVar[tuple[str, ...]] = ("loss_sum", "z_loss_sum", "weight_sum")

    def sums(self, model, out, batch: Batch, coefficients: Any = None):
        sums = lm_loss_sums(self.config, out.hidden, model.head_weight(), batch, self.mesh)
        return sums["loss_sum"], sums

    def result(self, sums: Sums):
        aux = {
            "learning/z_loss": token_mean(sums["z_loss_sum"], sums),
            "learning/total_weights": sums["weight_sum"],
        }
        return token_mean(sums["loss_sum"], sums), aux
