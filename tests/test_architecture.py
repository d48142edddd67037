"""docs/architecture.md's worked objective, run as the page shows it."""

from __future__ import annotations

import re
import sys
import types

import jax
import numpy as np
import pytest

from conftest import REPO, make_config
from kiln.parallel.mesh import make_mesh
from kiln.training import train
from kiln.training.batches import place_batch

MODEL = {"vocab_size": 64, "d_model": 32, "num_layers": 2, "num_heads": 2, "d_ff": 64}
MODEL.update(max_seq_len=16)
SEQ, BATCH = 16, 16


def page_blocks() -> list[str]:
    text = (REPO / "docs" / "architecture.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def example():
    # The block as a module of its own, as a user's file would be (dataclasses look it up).
    module = types.ModuleType("architecture_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile(page_blocks()[0], "docs/architecture.md", "exec"), module.__dict__)
        yield module.HiddenNormObjective
    finally:
        del sys.modules[module.__name__]


def config_with(accum: int):
    return make_config(
        model=MODEL,
        data={"seq_len": SEQ},
        mesh={"fsdp": -1},
        loss={"z_loss_multiplier": 1e-3},
        train={"global_batch_size": BATCH, "gradient_accumulation_steps": accum},
    )


def lm_batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL["vocab_size"], (BATCH, SEQ + 1), dtype=np.int32)
    weights = np.ones((BATCH, SEQ), np.float32)
    weights[1, 5:] = 0.0  # rows with different token counts
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy(),
        "segment_ids": np.ones((BATCH, SEQ), np.int32),
        "weights": weights,
    }


def test_the_example_objective_is_the_lm_loss_plus_its_penalty(example):
    config = config_with(accum=1)
    mesh = make_mesh(config)
    state = train.init_state(config, mesh)
    batch = lm_batch()
    penalty = 0.25
    objective = example(config=config, mesh=mesh, penalty=penalty)
    loss, aux, grads = train.run_objective(objective, state, batch)
    lm_loss, lm_aux, _ = train.loss_and_grads(config, state, batch)
    # The reference norm: the model's hidden states in float64, weighted mean over tokens.
    model = state.model()
    hidden = model.hidden_states(batch["inputs"], batch["positions"], batch["segment_ids"]).hidden
    w = batch["weights"].astype(np.float64)
    norm = (np.square(np.asarray(hidden, np.float64)).sum(-1) * w).sum() / w.sum()
    np.testing.assert_allclose(float(aux["hidden/norm_sq"]), norm, rtol=1e-5)  # f32 sums
    np.testing.assert_allclose(float(loss), float(lm_loss) + penalty * norm, rtol=1e-5)
    assert float(aux["learning/z_loss"]) == pytest.approx(
        float(lm_aux["learning/z_loss"]), rel=1e-6
    )

    # Accumulation changes nothing (sums over micro-batches, one division).
    config2 = config_with(accum=2)
    objective2 = example(config=config2, mesh=mesh, penalty=penalty)
    loss2, _, grads2 = train.run_objective(objective2, state, batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-5)  # f32, summed in another order
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


def test_the_example_trains_through_make_step(example):
    config = config_with(accum=2)
    mesh = make_mesh(config)
    state = train.init_state(config, mesh)
    # The page's second block, as written.
    namespace = {
        "HiddenNormObjective": example,
        "train": train,
        "config": config,
        "mesh": mesh,
        "state": state,
        "batch": lm_batch(),
    }
    exec(compile(page_blocks()[1], "docs/architecture.md", "exec"), namespace)
    metrics = namespace["metrics"]
    assert int(namespace["state"].step) == 1
    assert float(metrics["hidden/norm_sq"]) > 0
    assert np.isfinite(float(metrics["learning/loss"]))


def test_the_example_trains_an_moe_model_with_its_router_terms_unmentioned(example):
    """The page's objective names no router loss and no balancing bias; on an MoE model with
    both, the base class adds the router losses to its loss and its step moves the aux-free
    biases, as `kiln train`'s objective does."""
    moe = {"num_experts": 4, "experts_per_token": 2, "d_ff_expert": 16, "balance": "aux_free"}
    moe.update(router_z_loss=1e-3, load_balance_loss=1e-2)
    config = make_config(
        model={**MODEL, "family": "moe", "moe": moe},
        data={"seq_len": SEQ},
        mesh={"fsdp": -1},
        loss={"z_loss_multiplier": 1e-3},
        train={"global_batch_size": BATCH, "gradient_accumulation_steps": 2},
    )
    # One device: what is checked is which terms the loss holds, not how they shard.
    mesh = make_mesh(config, jax.devices()[:1])
    state = train.init_state(config, mesh)
    batch = lm_batch()
    objective = example(config=config, mesh=mesh, penalty=0.0)
    loss, aux, _ = train.run_objective(objective, state, batch)
    lm_loss, lm_aux, _ = train.loss_and_grads(config, state, batch)
    router = float(aux["learning/router_z_loss"]) + float(aux["learning/moe_lb_loss"])
    assert router > 0
    assert float(aux["learning/router_z_loss"]) == float(lm_aux["learning/router_z_loss"])
    np.testing.assert_allclose(float(loss), float(lm_loss), rtol=1e-6)  # f32, same sums
    step = train.make_step(objective, train.shardings_of(state))
    state, metrics = step(state, place_batch(batch, mesh, config))
    assert "learning/moe_lb_loss" in metrics
    bias = np.asarray(state.params["blocks"]["mlp"]["bias"].get_value())
    assert np.abs(bias).max() > 0  # the aux-free update ran after the step
