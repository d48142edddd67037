"""Train state, exact gradient accumulation and the pure train step.

A step optimises an `Objective` (`kiln.training.objective`): pre-training (`LMObjective`) and
distillation (`kiln.distill.online.DistillObjective`) are two. There is one
`objective_loss_and_grads` for all of them: it cuts the global batch into micro-batches,
accumulates weighted *sums* and their gradients in a `lax.scan`, and divides once by the global
token weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.config import Config, pipeline_split
from kiln.model import build_model, create_model, predicts_ahead
from kiln.model.attention import load_balanced
from kiln.parallel.mesh import (
    InMesh,
    batch_sharding,
    grad_reduce_dtype,
    in_mesh,
    make_mesh,
    sharded_abstract,
    state_shardings,
    use_mesh,
)
from kiln.parallel.pipeline import pipelined
from kiln.training.batches import Batch, balance_batch, micro_batches, place_batch
from kiln.training.objective import LMObjective, Objective, batch_totals, token_mean
from kiln.training.optim import make_optimizer, make_schedule


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
# Loss and gradients of a global batch


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


# ---------------------------------------------------------------------------------------------
# The step


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
