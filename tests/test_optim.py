"""Learning-rate schedules against their closed forms; the weight-decay mask by declared role."""

import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from kiln.config import OptimConfig
from kiln.errors import KilnError
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


class Box(nnx.Module):
    def __init__(self, **attributes):
        for name, value in attributes.items():
            setattr(self, name, value)


def param(role: str, *names: str, **metadata) -> nnx.Param:
    return nnx.Param(
        jnp.zeros((4,) * len(names)),
        out_sharding=names,
        eager_sharding=False,
        role=role,
        **metadata,
    )


# (path, role, decayed): names chosen so that a rule on name substrings ("norm", "scale",
# "bias") gets each one wrong; the decision must follow the declared role.
FOOLING = [
    ("upscale_proj.kernel", "matrix", True),
    ("norm_mixer.w", "matrix", True),
    ("biasing.head", "head", True),
    ("gain.g", "norm", False),
    ("shift.b", "bias", False),
    ("scale_table", "embedding", True),
]


def fooling_tree() -> nnx.State:
    modules: dict = {}
    for path, role, _ in FOOLING:
        *outer, leaf = path.split(".")
        extra = {"fan_in": ("embed",)} if role == "matrix" else {}
        value = param(role, "embed", "mlp", **extra)
        if outer:
            modules[outer[0]] = Box(**{leaf: value})
        else:
            modules[leaf] = value
    return nnx.state(Box(**modules), nnx.Param)


@pytest.mark.parametrize("decay_embeddings", [True, False])
def test_decay_mask_follows_declared_roles_not_names(decay_embeddings):
    mask = decay_mask(fooling_tree(), OptimConfig(decay_embeddings=decay_embeddings))
    got = {
        ".".join(str(k.key) for k in path): bool(v)
        for path, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(mask))
    }
    want = {
        path: decayed and (role != "embedding" or decay_embeddings)
        for path, role, decayed in FOOLING
    }
    assert got == want
    # Each name fools a substring rule: its decision differs from the role's on every row.
    substring = {path: not any(n in path for n in ("norm", "scale", "bias")) for path in want}
    assert all(substring[p] != d for p, _, d in FOOLING)


def test_a_parameter_without_a_role_is_refused_by_name_of_the_roles():
    tree = nnx.state(
        Box(w=nnx.Param(jnp.zeros((2, 3)), out_sharding=("embed", "mlp"), eager_sharding=False)),
        nnx.Param,
    )
    with pytest.raises(KilnError, match=r"declares role None; allowed: matrix, embedding"):
        decay_mask(tree, OptimConfig())
