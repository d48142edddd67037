"""Train state, the pure train step with exact gradient accumulation, and the training loop."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kiln import losses
from kiln.config import Config
from kiln.errors import KilnError
from kiln.mesh import batch_sharding, in_mesh, make_mesh, state_shardings
from kiln.model import create_model, flops_per_token
from kiln.optim import make_optimizer, make_schedule

Batch = Mapping[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "weights")


class TrainState(struct.PyTreeNode):
    """Everything a step changes: parameters, optimizer state and the step counter."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rest: nnx.State  # non-trainable model variables (usually empty)
    graphdef: nnx.GraphDef = struct.field(pytree_node=False)

    def model(self, params: nnx.State | None = None) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params if params is None else params, self.rest)


def init_state(config: Config, mesh: jax.sharding.Mesh | None = None) -> TrainState:
    """Model and optimizer state, created directly in their shardings on the mesh."""
    mesh = make_mesh(config) if mesh is None else mesh
    return state_from_model(config, mesh, create_model(config, mesh, config.train.seed))


def state_from_model(config: Config, mesh: jax.sharding.Mesh, model: nnx.Module) -> TrainState:
    """A train state (fresh optimizer, step 0) around a model whose parameters are on `mesh`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = make_optimizer(config.optim)
    # Moments carry their parameter's logical names, so they shard like it; counts replicate.
    opt_shardings = state_shardings(jax.eval_shape(tx.init, params), mesh, config.mesh.rules)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), NamedSharding(mesh, P()))
    return TrainState(step=step, params=params, opt_state=opt_state, rest=rest, graphdef=graphdef)


def shardings_of(state: TrainState):
    return jax.tree.map(lambda x: x.sharding, state)


# ---------------------------------------------------------------------------------------------
# Loss and gradients


def _micro_batches(batch: Batch, accum: int, mesh, rules) -> Batch:
    """[G, S] -> [accum, G/accum, S], micro-batch a = rows a, a+accum, ... (keeps each shard's rows)."""
    spec = P(None, _axes(rules["batch"]), _axes(rules["length"]))

    def split(x):
        g = x.shape[0]
        x = x.reshape(g // accum, accum, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return {k: split(batch[k]) for k in BATCH_KEYS}


def _axes(names):
    return tuple(names) if names else None


def model_loss_sums(config: Config, model, batch: Batch, mesh) -> dict[str, jax.Array]:
    """The model's LM loss sums on a batch (loss_sum, z_loss_sum, weight_sum), as configured."""
    hidden = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"]).hidden
    return hidden_loss_sums(config, hidden, model.head_weight(), batch, mesh)


def hidden_loss_sums(config: Config, hidden_BSD, head_DV, batch: Batch, mesh):
    """LM loss sums of final hidden states through the head, with the config's loss settings."""
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
    )


def _loss_sums_and_grads(config: Config, state: TrainState, params, batch: Batch, mesh):
    """Gradients of the weighted loss *sum* of one micro-batch, and its sums (float32)."""

    def loss_sum(params):
        sums = model_loss_sums(config, state.model(params), batch, mesh)
        return sums["loss_sum"], sums

    (_, sums), grads = jax.value_and_grad(loss_sum, has_aux=True)(params)
    return sums, jax.tree.map(lambda g: g.astype(jnp.float32), grads)


def accumulate(sums_and_grads: Callable, micro: Batch, params, param_shardings, sum_keys):
    """Sum `sums_and_grads(micro_batch) -> (sums, grads)` over the leading micro-batch axis.

    A `lax.scan`; `sums` is a dict of float32 scalars named by `sum_keys`; gradients
    accumulate in float32 in the parameters' shardings.
    """
    zero_grads = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    zero_grads = jax.lax.with_sharding_constraint(zero_grads, param_shardings)
    zero_sums = {k: jnp.zeros((), jnp.float32) for k in sum_keys}

    def body(carry, mb):
        sums, grads = sums_and_grads(mb)
        return jax.tree.map(jnp.add, carry, (sums, grads)), None

    (sums, grads), _ = jax.lax.scan(body, (zero_sums, zero_grads), micro)
    return sums, grads


def _loss_and_grads(config: Config, state: TrainState, batch: Batch, mesh, param_shardings):
    """Sums over micro-batches, one division by the global token weight (never a mean of means)."""
    accum = config.train.gradient_accumulation_steps
    if accum == 1:
        sums, grads = _loss_sums_and_grads(config, state, state.params, batch, mesh)
    else:
        micro = _micro_batches(batch, accum, mesh, config.mesh.rules)
        sums, grads = accumulate(
            lambda mb: _loss_sums_and_grads(config, state, state.params, mb, mesh),
            micro,
            state.params,
            param_shardings,
            ("loss_sum", "z_loss_sum", "weight_sum"),
        )
    total = sums["weight_sum"]
    denom = jnp.where(total > 0, total, 1.0)
    grads = jax.tree.map(lambda g: g / denom, grads)
    aux = {
        "z_loss": sums["z_loss_sum"] / denom,
        "total_weights": total,
    }
    return sums["loss_sum"] / denom, aux, grads


def loss_and_grads(config: Config, state: TrainState, batch: Batch):
    """(loss, aux, grads) of one global batch: per-token mean loss, aux z_loss/total_weights."""
    mesh = _mesh_of(state)
    key = (config.model_dump_json(), mesh, state.graphdef)
    fn = _LOSS_AND_GRADS.get(key)
    if fn is None:
        shardings = jax.tree.map(lambda x: x.sharding, state.params)
        fn = jax.jit(lambda s, b: _loss_and_grads(config, s, b, mesh, shardings))
        fn = in_mesh(fn, mesh, config.mesh.rules)
        _LOSS_AND_GRADS[key] = fn
    return fn(state, place_batch(batch, mesh, config))


# Compiled `loss_and_grads` per (config, mesh, model structure): repeated calls reuse one program.
_LOSS_AND_GRADS: dict = {}


def _mesh_of(state: TrainState):
    return jax.tree.leaves(state.params)[0].sharding.mesh


def place_batch(batch: Mapping[str, Any], mesh, config: Config) -> Batch:
    """Put this process's rows of a global batch on the mesh as global arrays.

    Process p of P holds rows p*n .. (p+1)*n - 1 of the global batch (n = its row count), the
    rows its own devices hold, so the global array is the same for any number of processes.
    """
    sharding = batch_sharding(mesh, config.mesh.rules)
    out = {}
    for k in BATCH_KEYS:
        x = batch[k]
        if isinstance(x, jax.Array) and x.sharding == sharding:
            out[k] = x
        else:
            x = np.asarray(x)
            shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
            _check_process_rows(sharding, shape)
            out[k] = jax.make_array_from_process_local_data(sharding, x, shape)
    return out


@functools.lru_cache(maxsize=8)
def _check_process_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> None:
    """KilnError unless this process's devices hold exactly its own block of batch rows."""
    n, p = shape[0] // jax.process_count(), jax.process_index()
    held = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        held.update(range(*index[0].indices(shape[0])))
    if held != set(range(p * n, (p + 1) * n)):
        raise KilnError(
            f"mesh: the devices of process {p} hold {len(held)} rows of each global batch "
            f"(from row {min(held)}), but its data are rows {p * n}..{(p + 1) * n - 1}; split the "
            f"batch over the {jax.process_count()} processes: mesh.data * mesh.fsdp must be a "
            "multiple of the process count (tensor and sequence axes within a process)"
        )


# ---------------------------------------------------------------------------------------------
# The step


def make_train_step(config: Config, mesh, shardings: TrainState) -> Callable:
    """The jitted pure `train_step(state, batch) -> (state, metrics)` with donated state."""
    update = make_update(config)

    def train_step(state: TrainState, batch: Batch):
        loss, aux, grads = _loss_and_grads(config, state, batch, mesh, shardings.params)
        return update(state, loss, aux, grads)

    data = batch_sharding(mesh, config.mesh.rules)
    jitted = jax.jit(
        train_step,
        in_shardings=(shardings, {k: data for k in BATCH_KEYS}),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )
    return in_mesh(jitted, mesh, config.mesh.rules)


def make_update(config: Config) -> Callable:
    """`update(state, loss, aux, grads) -> (state, metrics)`; skipped if any is non-finite."""
    tx = make_optimizer(config.optim)
    schedule = make_schedule(config.optim, config.train.steps)
    clip = config.optim.grad_clip

    def update(state: TrainState, loss, aux, grads):
        raw_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(raw_norm)
        lr = schedule(state.step)

        def apply(operand):
            params, opt_state = operand
            updates, opt_state = tx.update(grads, opt_state, params)
            updates = jax.tree.map(lambda u: -lr * u, updates)
            return optax.apply_updates(params, updates), opt_state

        params, opt_state = jax.lax.cond(
            finite, apply, lambda operand: operand, (state.params, state.opt_state)
        )
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        metrics = {
            "learning/loss": loss,
            "learning/z_loss": aux["z_loss"],
            "learning/total_weights": aux["total_weights"],
            "learning/raw_grad_norm": raw_norm,
            "learning/grad_norm": raw_norm if clip is None else jnp.minimum(raw_norm, clip),
            "learning/param_norm": optax.tree.norm(params),
            "learning/current_learning_rate": lr,
            **new_state.model().diagnostics(),
            "learning/step_skipped": (~finite).astype(jnp.float32),
        }
        return new_state, metrics

    return update


def make_eval_step(config: Config, mesh) -> Callable:
    """Jitted `eval_step(state, batch) -> sums` (loss_sum, z_loss_sum, weight_sum), forward only."""

    def eval_step(state: TrainState, batch: Batch):
        return model_loss_sums(config, state.model(), batch, mesh)

    return in_mesh(jax.jit(eval_step), mesh, config.mesh.rules)


def evaluate(eval_step, state: TrainState, batches, mesh, config: Config) -> dict[str, float]:
    """eval/loss (with z-term, as learning/loss), eval/z_loss and eval/perplexity (of the CE alone)."""
    totals = {"loss_sum": 0.0, "z_loss_sum": 0.0, "weight_sum": 0.0}
    for batch in batches:
        sums = jax.device_get(eval_step(state, place_batch(batch, mesh, config)))
        for k in totals:
            totals[k] += float(sums[k])
    w = max(totals["weight_sum"], 1e-30)
    loss, z = totals["loss_sum"] / w, totals["z_loss_sum"] / w
    return {"eval/loss": loss, "eval/z_loss": z, "eval/perplexity": math.exp(min(loss - z, 80.0))}


# ---------------------------------------------------------------------------------------------
# The loop


def run(config: Config) -> TrainState:
    """`kiln train`: validate against devices, data and any earlier run; then train and save."""
    from kiln.checkpoint import restore_params
    from kiln.data import make_datasets
    from kiln.distributed import initialize
    from kiln.runner import restore_latest, resume_notes

    initialize(config)  # before any device is touched
    mesh = make_mesh(config)
    datasets = make_datasets(config)
    notes = resume_notes(config)
    state = init_state(config, mesh)
    train_iter = datasets.train_iterator()
    state, resumed = restore_latest(config, state, train_iter)
    if resumed:
        notes.insert(0, resumed)
    elif config.checkpoint.load_params_from:
        params, step = restore_params(config.checkpoint.load_params_from, state.params)
        state = state.replace(params=params)
        notes.insert(0, f"parameters from {config.checkpoint.load_params_from} (step {step})")
    return run_loop(
        config,
        mesh,
        state,
        step_fn=make_train_step(config, mesh, shardings_of(state)),
        datasets=datasets,
        batches=train_iter,
        notes=notes,
        flops_per_token=flops_per_token(config.model, config.data.seq_len),
    )


def run_loop(config, mesh, state, *, step_fn, datasets, batches, notes, flops_per_token):
    """Write the run directory (everything is validated by now), then loop, log and save."""
    from kiln.checkpoint import Checkpointer
    from kiln.metrics import MetricsLogger
    from kiln.runner import Loop, open_run_dir

    run_dir = config.run_dir
    is_main = open_run_dir(run_dir, config)
    ckpt = Checkpointer(run_dir, config.checkpoint)
    logger = MetricsLogger(run_dir, config, enabled=is_main, start_step=int(state.step))
    for note in notes:
        logger.info(note)

    eval_fn = None
    if config.train.eval_every_steps:
        eval_step = make_eval_step(config, mesh)
        eval_batches = datasets.eval_batches(config.train.eval_batches)

        def eval_fn(state):
            return evaluate(eval_step, state, eval_batches, mesh, config)

    loop = Loop(
        config=config,
        step_fn=step_fn,
        place=lambda batch: place_batch(batch, mesh, config),
        batches=batches,
        ckpt=ckpt,
        logger=logger,
        flops_per_token=flops_per_token,
        evaluate=eval_fn,
    )
    try:
        return loop.run(state)
    finally:
        ckpt.close()
        logger.close()
