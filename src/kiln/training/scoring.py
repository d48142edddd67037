"""Scoring evaluation tasks with a model on the run's mesh: the jitted forward passes and metrics.

perplexity: the held-out loss path of training (`train.make_eval_step`) with the z-loss and
label smoothing set to 0, so the loss is the plain negative log-likelihood per token:
    loss = sum NLL / predicted tokens,  perplexity = exp(loss),
    bits_per_byte = sum NLL / (ln 2 * UTF-8 bytes of the documents).
choice: the log-likelihood of each choice given its context, summed over the choice's tokens
only; acc = argmax of the sums is the gold choice, acc_norm = the same for sums divided by the
choice's UTF-8 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kiln.config import Config
from kiln.data.eval_tasks import (
    ChoiceTask,
    PerplexityTask,
    TaskSpec,
    choice_batches,
    choice_metrics,
    load_choice,
    load_perplexity,
    window_batches,
)
from kiln.data.tokenizers import Tokenizer
from kiln.parallel.mesh import in_mesh
from kiln.training import train
from kiln.training.batches import Batch, place_batch

# The metrics logged as eval/<task>/<metric> (the rest, counts, go to eval.json only).
LOGGED = ("loss", "perplexity", "bits_per_byte", "acc", "acc_norm")


def load_tasks(specs: Sequence[TaskSpec], config: Config, tokenizer: Tokenizer) -> list[Any]:
    """Every task's data, tokenized with the run's tokenizer (KilnError for bad files)."""
    m = config.model
    return [
        load_perplexity(s, tokenizer, m.vocab_size, config.data.seq_len)
        if s.kind == "perplexity"
        else load_choice(s, tokenizer, m.vocab_size, m.max_seq_len)
        for s in specs
    ]


def continuation_loglik(state, batch: Batch) -> jax.Array:
    """[B] float32: sum over positions of log p(target) * weight, from the full logits."""
    model = state.model()
    hidden = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"]).hidden
    logits_BSV = model.logits(hidden)
    logp_BSV = logits_BSV - jax.nn.logsumexp(logits_BSV, axis=-1, keepdims=True)
    logp_BS = jnp.take_along_axis(logp_BSV, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(logp_BS * batch["weights"], axis=1)


class Evaluator:
    """Runs tasks against a model state: anything with `.model()` (a TrainState, a ModelState)."""

    def __init__(self, config: Config, mesh: Mesh, tasks: Sequence[Any]):
        self.config, self.mesh, self.tasks = config, mesh, list(tasks)
        plain = config.loss.model_copy(update={"z_loss_multiplier": 0.0, "label_smoothing": 0.0})
        self._sums = train.make_eval_step(config.model_copy(update={"loss": plain}), mesh)
        replicated = NamedSharding(mesh, P())
        jitted = jax.jit(continuation_loglik, out_shardings=replicated)
        self._loglik = in_mesh(jitted, mesh, config.mesh.rules)
        batch = config.train.global_batch_size
        self._choice = {
            t.spec.name: list(choice_batches(t, batch, config.model.max_seq_len))
            for t in self.tasks
            if isinstance(t, ChoiceTask)
        }

    def run(self, state) -> dict[str, dict[str, float]]:
        """{task name: {metric: value}}, counts included."""
        return {t.spec.name: self._run_one(t, state) for t in self.tasks}

    def metrics(self, state) -> dict[str, float]:
        """eval/<task>/<metric> of the logged metrics, as the training loop writes them."""
        return tags(self.run(state))

    def _run_one(self, task, state) -> dict[str, float]:
        if isinstance(task, PerplexityTask):
            return self._perplexity(task, state)
        return choice_metrics(task, self.choice_loglik(task, state))

    def _place(self, batch):
        """This process's rows of a global batch, placed on the mesh."""
        k = len(batch["inputs"]) // jax.process_count()
        p = jax.process_index()
        local = {key: v[p * k : (p + 1) * k] for key, v in batch.items()}
        return place_batch(local, self.mesh, self.config)

    def _perplexity(self, task: PerplexityTask, state) -> dict[str, float]:
        nll = weight = 0.0
        for batch in window_batches(task, self.config.train.global_batch_size):
            sums = jax.device_get(self._sums(state, self._place(batch)))
            nll += float(sums["loss_sum"])
            weight += float(sums["weight_sum"])
        loss = nll / weight
        return {
            "loss": loss,
            "perplexity": math.exp(min(loss, 80.0)),
            "bits_per_byte": nll / math.log(2) / task.num_bytes,
            "tokens": weight,
            "bytes": float(task.num_bytes),
            "documents": float(task.num_documents),
        }

    def choice_loglik(self, task: ChoiceTask, state) -> np.ndarray:
        """[rows] float64: each (question, choice)'s summed continuation log-likelihood."""
        out = np.zeros(len(task.rows))
        for idx, batch in self._choice[task.spec.name]:
            out[idx] = np.asarray(jax.device_get(self._loglik(state, self._place(batch))))[
                : len(idx)
            ]
        return out


def tags(results: dict[str, dict[str, float]]) -> dict[str, float]:
    """{eval/<task>/<metric>: value} of the metrics that are logged."""
    return {
        f"eval/{name}/{metric}": value
        for name, values in results.items()
        for metric, value in values.items()
        if metric in LOGGED
    }
