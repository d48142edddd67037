"""Learning-rate schedules against their closed forms; the weight-decay mask."""

import math

import jax.numpy as jnp
import pytest

from kiln.config import OptimConfig
from kiln.training.optim import decay_mask, make_schedule

LR, STEPS, WARMUP, F = 1e-3, 100, 10, 0.1


def lr_at(schedule: str, step: int, **kw) -> float:
    cfg = OptimConfig(
        learning_rate=LR, schedule=schedule, warmup_steps=WARMUP, final_lr_fraction=F, **kw
    )
    return float(make_schedule(cfg, STEPS)(jnp.int32(step)))


@pytest.mark.parametrize("schedule", ["constant", "cosine", "linear", "wsd"])
def test_warmup_is_linear_to_the_peak(schedule):
    for step in (0, 4, 9):
        assert math.isclose(lr_at(schedule, step), LR * (step + 1) / WARMUP, rel_tol=1e-6)


def test_constant():
    assert all(math.isclose(lr_at("constant", s), LR, rel_tol=1e-6) for s in (10, 50, 99))


@pytest.mark.parametrize("step", [10, 32, 55, 77, 99, 100])
def test_cosine_closed_form(step):
    p = (step - WARMUP) / (STEPS - WARMUP)
    want = LR * (F + (1 - F) * 0.5 * (1 + math.cos(math.pi * p)))
    assert math.isclose(lr_at("cosine", step), want, rel_tol=1e-5)


@pytest.mark.parametrize("step", [10, 40, 99, 100])
def test_linear_closed_form(step):
    p = (step - WARMUP) / (STEPS - WARMUP)
    assert math.isclose(lr_at("linear", step), LR * (1 - (1 - F) * p), rel_tol=1e-5)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
@pytest.mark.parametrize("step", [10, 50, 79, 80, 85, 90, 100])
def test_wsd_closed_form(shape, step):
    # 20% of 100 steps decay: stable until step 80, then down to F * LR at step 100.
    got = lr_at("wsd", step, decay_fraction=0.2, decay_shape=shape)
    p = max(0.0, (step - 80) / 20)
    frac = 1 - (1 - F) * p if shape == "linear" else F + (1 - F) * 0.5 * (1 + math.cos(math.pi * p))
    assert math.isclose(got, LR * frac, rel_tol=1e-5)


def test_decay_mask_excludes_norms_and_biases():
    params = {
        "embed": {"embedding": jnp.zeros((4, 2))},
        "layers": {
            "attn_norm": {"scale": jnp.zeros((3, 2))},
            "mlp": {"kernel": jnp.zeros((3, 2, 2))},
        },
        "final_norm": {"scale": jnp.zeros(2)},
        "proj": {"bias": jnp.zeros(2)},
    }
    mask = decay_mask(params)
    assert mask["embed"]["embedding"] and mask["layers"]["mlp"]["kernel"]
    assert not mask["layers"]["attn_norm"]["scale"]
    assert not mask["final_norm"]["scale"]
    assert not mask["proj"]["bias"]
