"""Train state, the objective seam, exact gradient accumulation and the pure train step.

A step optimises an `Objective`: pre-training (`LMObjective`) and distillation
(`kiln.distill.online.DistillObjective`) are two. There is one `objective_loss_and_grads` for all of
them: it cuts the global batch into micro-batches, accumulates weighted *sums* and their
gradients in a `lax.scan`, and divides once by the global token weight.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln import losses
from kiln.config import Config, pipeline_split
from kiln.errors import KilnError
from kiln.model import (
    ModelOutput,
    aux_metrics,
    build_model,
    create_model,
    flops_per_token,
    predicts_ahead,
)
from kiln.model.attention import balanced_order, load_balanced, sequence_shards
from kiln.model.project import grad_reduce_dtype
from kiln.parallel.mesh import (
    InMesh,
    batch_sharding,
    in_mesh,
    logical_spec,
    make_mesh,
    sharded_abstract,
    state_shardings,
    use_mesh,
)
from kiln.parallel.pipeline import pipelined
from kiln.training.optim import make_optimizer, make_schedule

Batch = Mapping[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")
Sums = dict[str, jax.Array]


class TrainState(struct.PyTreeNode):
    """Everything a step changes: parameters, optimizer state and the step counter."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rest: nnx.State  # non-trainable model variables (usually empty)
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)

    def model(self, params: nnx.State | None = None) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def init_state(config: Config, mesh: Mesh | None = None) -> TrainState:
    """Model and optimizer state, created directly in their shardings on the mesh."""
    mesh = make_mesh(config) if mesh is None else mesh
    return state_from_model(config, mesh, create_model(config, mesh, config.train.seed))


def state_from_model(config: Config, mesh: Mesh, model: nnx.Module) -> TrainState:
    """A train state (fresh optimizer, step 0) around a model whose parameters are on `mesh`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = _optimizer_init(config, mesh, params)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return TrainState(step=step, params=params, opt_state=opt_state, rest=rest, graphdef=graphdef)


def abstract_train_state(config: Config, mesh: Mesh, build: Callable[[], nnx.Module]) -> TrainState:
    """The train state of the model `build()` makes, as sharded ShapeDtypeStructs: allocates nothing.

    The same shardings as `state_from_model` gives the real state (`kiln compile` lowers the
    step with it).
    """
    graphdef, abstract = sharded_abstract(build, mesh, config.mesh.rules)
    params, rest = nnx.split_state(abstract, nnx.Param, ...)
    opt_state = jax.eval_shape(_optimizer_init(config, mesh, params), params)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))
    return TrainState(step=step, params=params, opt_state=opt_state, rest=rest, graphdef=graphdef)


def _optimizer_init(config: Config, mesh: Mesh, params: nnx.State) -> Callable:
    """The optimizer's jitted `init(params)`, its state in the parameters' shardings."""
    tx = make_optimizer(config.optim)
    # Moments carry their parameter's logical names, so they shard like it; counts replicate.
    abstract = jax.eval_shape(tx.init, params)
    opt_shardings = state_shardings(abstract, mesh, config.mesh.rules, derived=True)
    return jax.jit(tx.init, out_shardings=opt_shardings)


def shardings_of(tree):
    """The sharding of every array of a pytree (a train state, an objective)."""
    return jax.tree.map(lambda x: x.sharding, tree)


# ---------------------------------------------------------------------------------------------
# The objective seam


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


# ---------------------------------------------------------------------------------------------
# Loss and gradients of a global batch


def micro_batches(batch: Batch, accum: int, mesh: Mesh, rules) -> Batch:
    """[G, S] -> [accum, G/accum, S], micro-batch a = rows a, a+accum, ... (keeps each shard's rows)."""
    sharding = NamedSharding(mesh, logical_spec((None, "batch", "length"), rules))

    def split(x):
        g = x.shape[0]
        x = x.reshape(g // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, sharding)

    return {k: split(x) for k, x in batch.items()}


def objective_loss_and_grads(objective: Objective, state: TrainState, batch: Batch):
    """(loss, aux, grads) of a global batch: sums over micro-batches, one division by the weight.

    Traced inside jit. Gradients accumulate in float32 in the parameters' shardings.
    """
    config, mesh = objective.config, objective.mesh
    # With pipeline stages each accumulation micro-batch is cut into the pipeline's.
    accum, pieces = pipeline_split(config, dict(mesh.shape).get("stage", 1))
    with pipelined(config.pipeline.repeats, pieces):
        return _loss_and_grads(objective.for_step(state.step), state, batch, accum)


def _loss_and_grads(objective: Objective, state: TrainState, batch: Batch, accum: int):
    config, mesh = objective.config, objective.mesh

    # Of the global batch: the model's loss terms per its tokens, the modules' per their weight.
    totals = batch_totals(batch, predicts_ahead(config.model)[0])

    def loss_sums(params, mb, coefficients):
        return objective.loss_sums(state.model(params), mb, coefficients, totals)

    reduce_dtype = None if config.train.grad_reduce_dtype == "compute" else jnp.float32

    def sums_and_grads(mb, coefficients):
        grad_fn = jax.value_and_grad(loss_sums, has_aux=True)
        with grad_reduce_dtype(reduce_dtype):
            (_, sums), grads = grad_fn(state.params, mb, coefficients)
        return sums, jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    if accum == 1:
        sums, grads = sums_and_grads(batch, None)
    else:
        micro = micro_batches(batch, accum, mesh, config.mesh.rules)
        first = jax.tree.map(lambda x: x[0], micro)
        # The sums' shapes (the model's aux may add its own), from an abstract trace.
        shapes = jax.eval_shape(lambda: loss_sums(state.params, first, None)[1])
        zero_sums = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)
        coefficients = None
        if objective.needs_global_sums:
            # A forward pass over the micro-batches for the sums the coefficients depend on.
            def add_sums(total, mb):
                sums = loss_sums(state.params, mb, None)[1]
                return jax.tree.map(jnp.add, total, sums), None

            global_sums, _ = jax.lax.scan(add_sums, zero_sums, micro)
            coefficients = objective.coefficients(global_sums)
        shardings = state_shardings(state.params, mesh, config.mesh.rules)
        zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
        zero_grads = jax.lax.with_sharding_constraint(zero_grads, shardings)

        def add(carry, mb):
            return jax.tree.map(jnp.add, carry, sums_and_grads(mb, coefficients)), None

        (sums, grads), _ = jax.lax.scan(add, (zero_sums, zero_grads), micro)
    grads = jax.tree.map(lambda g: token_mean(g, sums), grads)
    loss, aux = objective.finalize(sums)
    return loss, aux, grads


# Compiled once per objective (its static config and mesh are part of jit's cache key).
_jitted_loss_and_grads = jax.jit(objective_loss_and_grads)


def run_objective(objective: Objective, state: TrainState, batch: Mapping[str, Any]):
    """(loss, aux, grads) of one global batch, compiled once per objective and state structure."""
    placed = place_batch(batch, objective.mesh, objective.config)
    with use_mesh(objective.mesh, objective.config.mesh.rules):
        return _jitted_loss_and_grads(objective, state, placed)


def loss_and_grads(config: Config, state: TrainState, batch: Mapping[str, Any]):
    """(loss, aux, grads) of one global batch: per-token mean loss, aux learning/z_loss,
    learning/total_weights and the model's aux terms."""
    return run_objective(LMObjective(config=config, mesh=mesh_of(state)), state, batch)


def mesh_of(state: TrainState) -> Mesh:
    return jax.tree.leaves(state.params)[0].sharding.mesh


def place_batch(batch: Mapping[str, Any], mesh: Mesh, config: Config) -> Batch:
    """Put this process's rows of a global batch on the mesh as global arrays.

    Process p of P holds rows p*n .. (p+1)*n - 1 of the global batch (n = its row count), the
    rows its own devices hold, so the global array is the same for any number of processes.
    """
    sharding = batch_sharding(mesh, config.mesh.rules)
    out = {}
    # Keys beyond the token stream's (e.g. stored teacher logits) share its leading [B, S] layout.
    for k in (*BATCH_KEYS, *(k for k in batch if k not in BATCH_KEYS)):
        x = batch[k]
        if isinstance(x, jax.Array) and x.sharding == sharding:
            out[k] = x
        else:
            x = np.asarray(x)
            shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            _check_process_rows(sharding, shape, jax.process_index(), jax.process_count())
            out[k] = jax.make_array_from_process_local_data(sharding, x, shape)
    return out


@functools.lru_cache(maxsize=8)
def _check_process_rows(sharding: NamedSharding, shape: tuple[int, ...], p: int, count: int):
    """KilnError unless process `p` of `count` has devices holding exactly its own batch rows."""
    n = shape[0] // count
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        held.update(range(*index[0].indices(shape[0])))
    if held != set(range(p * n, (p + 1) * n)):
        raise KilnError(
            f"mesh: the devices of process {p} hold {len(held)} rows of each global batch "
            f"(from row {min(held)}), but its data are rows {p * n}..{(p + 1) * n - 1}; split the "
            f"batch over the {count} processes: mesh.data * mesh.fsdp must be a "
            "multiple of the process count (tensor and sequence axes within a process)"
        )


# ---------------------------------------------------------------------------------------------
# The step


def balance_batch(batch: Batch, config: Config, data: NamedSharding) -> tuple[Batch, bool]:
    """(the batch, whether it is placed for load balance): every key's rows [B, S, ...] in
    `balanced_order` when `model.context_load_balance` is on for the traced mesh's sequence
    shards. Traced inside the step: a static permutation of the tokens along the sequence,
    which moves at most half of each shard's token ids (and positions, segment ids, weights)
    to another shard; the model's activations are then placed so from the embedding on."""
    shards = sequence_shards()
    if not config.model.balances_context(shards):
        return batch, False
    order = balanced_order(config.data.seq_len, shards)
    placed = {
        k: jax.lax.with_sharding_constraint(jnp.take(x, order, axis=1), data)
        for k, x in batch.items()
    }
    return placed, True


def make_step(objective: Objective, shardings: TrainState) -> InMesh:
    """The jitted pure `step(state, batch) -> (state, metrics)` of an objective, donated state.

    The objective's arrays (e.g. a teacher's parameters) are arguments of the compiled step,
    never constants folded into it.
    """
    config, mesh = objective.config, objective.mesh
    update = make_update(config)

    data = batch_sharding(mesh, config.mesh.rules)

    def step(objective: Objective, state: TrainState, batch: Batch):
        batch, balanced = balance_batch(batch, config, data)
        with load_balanced(balanced):
            loss, aux, grads = objective_loss_and_grads(objective, state, batch)
        return update(state, loss, aux, grads)

    jitted = jax.jit(
        step,
        in_shardings=(shardings_of(objective), shardings, data),  # every batch key: [B, S, ...]
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=1,
    )
    return in_mesh(jitted, mesh, config.mesh.rules, objective)


def make_train_step(config: Config, mesh: Mesh, shardings: TrainState) -> InMesh:
    """The jitted pre-training `train_step(state, batch) -> (state, metrics)`, donated state."""
    return make_step(LMObjective(config=config, mesh=mesh), shardings)


def make_update(config: Config) -> Callable:
    """`update(state, loss, aux, grads) -> (state, metrics)`; skipped if any is non-finite.

    The metrics are the loss, every scalar of `aux` whose key is a tag (contains "/"), in the
    order `finalize` gives them, and the update's own (norms, learning rate, ...). After the
    optimizer, the model moves what it keeps outside the gradient (`update_balance`).
    """
    tx = make_optimizer(config.optim)
    schedule = make_schedule(config.optim, config.train.steps)
    clip = config.optim.grad_clip

    def update(state: TrainState, loss, aux, grads):
        raw_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(raw_norm)
        lr = schedule(state.step)

        def apply(operand):
            params, old_state = operand
            updates, opt_state = tx.update(grads, old_state, params)
            # The state keeps its dtypes (model.param_dtype's moments) under float32 gradients.
            opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, old_state)
            updates = jax.tree.map(lambda u: -lr * u, updates)
            model = state.model(optax.apply_updates(params, updates))
            model.update_balance(aux)
            return nnx.state(model, nnx.Param), opt_state

        params, opt_state = jax.lax.cond(
            finite, apply, lambda operand: operand, (state.params, state.opt_state)
        )
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        metrics = {
            "learning/loss": loss,
            **{k: v for k, v in aux.items() if "/" in k and jnp.ndim(v) == 0},
            "learning/raw_grad_norm": raw_norm,
            "learning/grad_norm": raw_norm if clip is None else jnp.minimum(raw_norm, clip),
            "learning/param_norm": optax.tree.norm(params),
            "learning/current_learning_rate": lr,
            **new_state.model().diagnostics(),
            "learning/step_skipped": (~finite).astype(jnp.float32),
        }
        return new_state, metrics

    return update


# ---------------------------------------------------------------------------------------------
# Evaluation


def make_eval_step(config: Config, mesh: Mesh) -> Callable:
    """Jitted `eval_step(state, batch) -> sums` (loss_sum, z_loss_sum, weight_sum), forward only."""
    objective = LMObjective(config=config, mesh=mesh)

    accum, pieces = pipeline_split(config, dict(mesh.shape).get("stage", 1))

    def eval_step(state: TrainState, batch: Batch):
        with pipelined(config.pipeline.repeats, accum * pieces):  # the batch is a whole step's
            return objective.loss_sums(state.model(), batch)[1]

    return in_mesh(jax.jit(eval_step), mesh, config.mesh.rules)


def evaluate(eval_step, state: TrainState, batches, mesh, config: Config) -> dict[str, float]:
    """eval/loss (with z-term, as learning/loss, but without a model's own loss terms such as an
    MoE router's), eval/z_loss and eval/perplexity (of the CE alone)."""
    totals = {"loss_sum": 0.0, "z_loss_sum": 0.0, "weight_sum": 0.0}
    for batch in batches:
        sums = jax.device_get(eval_step(state, place_batch(batch, mesh, config)))
        for k in totals:
            totals[k] += float(sums[k])
    w = max(totals["weight_sum"], 1e-30)
    loss, z = totals["loss_sum"] / w, totals["z_loss_sum"] / w
    return {"eval/loss": loss, "eval/z_loss": z, "eval/perplexity": math.exp(min(loss - z, 80.0))}


# ---------------------------------------------------------------------------------------------
# Pre-training


def pretraining(config: Config, mesh: Mesh) -> tuple[Objective, TrainState, list[str]]:
    """The pre-training objective and a fresh train state (see `kiln.training.runner.prepare_run`)."""
    return LMObjective(config=config, mesh=mesh), init_state(config, mesh), []


def abstract_pretraining(config: Config, mesh: Mesh) -> tuple[Objective, TrainState]:
    """`kiln train`'s objective and its train state as sharded ShapeDtypeStructs (`kiln compile`)."""
    state = abstract_train_state(config, mesh, lambda: build_model(config.model, rngs=nnx.Rngs(0)))
    return LMObjective(config=config, mesh=mesh), state


def abstract_batch(config: Config, mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch as ShapeDtypeStructs in the sharding `place_batch` gives the real one."""
    shape = (config.train.global_batch_size, config.data.seq_len)
    sharding = batch_sharding(mesh, config.mesh.rules)
    dtype = {k: jnp.float32 if k == "weights" else jnp.int32 for k in BATCH_KEYS}
    return {k: jax.ShapeDtypeStruct(shape, dtype[k], sharding=sharding) for k in BATCH_KEYS}
